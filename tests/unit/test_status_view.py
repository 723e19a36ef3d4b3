"""``psctl status`` rendering from Status replies: tables a person reads, JSON a script reads."""

from __future__ import annotations

import json

from psctl.status_view import Status, all_serving, render_json, render_table, to_data
from pswire.proto import ps_pb2


def reply(clocks: dict[int, int], live: list[int], checkpoint: int = -1) -> ps_pb2.StatusResponse:
    job = ps_pb2.JobSpec(mode="ssp", staleness=4, num_workers=3)
    job.optimizer.name = "sgd"
    job.variables.add(name="fc.weight", dtype="float32", shape=[10, 4])
    status = ps_pb2.StatusResponse(
        initialized=True,
        job=job,
        clock=sum(clocks.values()),
        total_bytes=160,
        pushes_applied=sum(clocks.values()),
        pushes_duplicate=1,
        pushes_late=2,
        live_workers=live,
        incarnation="abc",
        checkpoint_step=checkpoint,
        checkpoint_age_s=12.5 if checkpoint >= 0 else -1.0,
    )
    for worker, clock in clocks.items():
        status.workers.add(worker_id=worker, clock=clock, seconds_since_heartbeat=0.5 + worker)
    return status


ADDRESSES = ["ps0:7000", "ps1:7000", "ps2:7000"]


def test_table_shows_shards_workers_staleness_and_checkpoints() -> None:
    statuses: list[Status] = [
        reply({0: 9, 1: 7, 2: 3}, live=[0, 1], checkpoint=8),
        reply({0: 9, 1: 8, 2: 3}, live=[0, 1]),
        "no answer from ps2:7000 within 5s",
    ]
    health = ["SERVING", "SERVING", "UNREACHABLE"]
    table = render_table(ADDRESSES, statuses, health)
    lines = table.splitlines()
    assert lines[0].split() == [
        "SHARD", "ADDRESS", "HEALTH", "MODE", "CLOCK", "VARS", "BYTES", "LIVE", "STALENESS",
        "PUSHES/DUP", "LATE", "LAST", "CHECKPOINT",
    ]  # fmt: skip
    # Staleness: the clock spread among live workers (9 - 7); worker 2 is dead, not stale.
    assert lines[1].split() == [
        "0", "ps0:7000", "SERVING", "ssp(4)", "19", "1", "160", "B", "2/3", "2", "19/1", "2",
        "step", "8,", "12.5s", "ago",
    ]  # fmt: skip
    assert lines[2].split()[-1] == "none"
    assert lines[3].split()[:3] == ["2", "ps2:7000", "UNREACHABLE"]
    assert "shard 2 (ps2:7000): no answer from ps2:7000 within 5s" in table
    header = lines.index(next(line for line in lines if line.startswith("WORKER")))
    assert lines[header].split() == [
        "WORKER", "CLOCKS", "(shards", "0,1)", "STALENESS", "LIVE", "LAST", "SEEN",
    ]  # fmt: skip
    # Worker 1: clocks 7 and 8, 2 behind the newest (9), live on both shards, heard 1.5s ago.
    assert lines[header + 2].split() == ["1", "7", "8", "2", "yes", "1.5s", "ago"]
    # Worker 2: out of the quorum, and 6 steps behind.
    assert lines[header + 3].split() == ["2", "3", "3", "6", "dropped", "2.5s", "ago"]
    assert "fc.weight  0      10x4   float32" in table
    assert not all_serving(health, statuses)


def test_json_has_every_field_and_merged_workers() -> None:
    statuses: list[Status] = [reply({0: 5, 1: 4}, live=[0, 1], checkpoint=4), reply({0: 5}, [0])]
    data = json.loads(render_json(ADDRESSES[:2], statuses, ["SERVING", "SERVING"]))
    assert data == to_data(ADDRESSES[:2], statuses, ["SERVING", "SERVING"])
    shard = data["shards"][0]
    assert shard["checkpoint"] == {"step": 4, "age_s": 12.5}
    assert (shard["pushes_late"], shard["max_staleness"], shard["mode"]) == (2, 1, "ssp")
    assert (shard["staleness"], shard["num_variables"], shard["total_bytes"]) == (4, 1, 160)
    assert shard["variables"] == [{"name": "fc.weight", "dtype": "float32", "shape": [10, 4]}]
    workers = {w["worker_id"]: w for w in data["workers"]}
    assert (workers[0]["clocks"], workers[1]["clocks"]) == ([5, 5], [4, None])
    # Shard 1 never heard of worker 1: not live cluster-wide.
    assert workers[1]["live"] is False and workers[0]["live"] is True
    assert all_serving(["SERVING", "SERVING"], statuses)


def test_tables_show_their_ids_rows_bytes_and_evictions() -> None:
    statuses: list[Status] = []
    for shard, (start, end) in enumerate([(0, 500), (500, 1000)]):
        status = reply({0: 3}, live=[0])
        fixed = status.job.variables.add(name="user", dtype="float32", shape=[end - start, 8])
        fixed.table.num_rows, fixed.table.row_start, fixed.table.row_end = 1000, start, end
        hashed = status.job.variables.add(name="item", dtype="float32", shape=[0, 4])
        hashed.table.capacity = 100
        status.tables.add(name="user", rows=end - start, bytes=(end - start) * 32)
        status.tables.add(name="item", rows=100, bytes=1600, evictions=7 + shard, capacity=100)
        statuses.append(status)
    table = render_table(ADDRESSES[:2], statuses, ["SERVING", "SERVING"])
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("TABLE"))
    assert lines[header].split() == [
        "TABLE", "SHARD", "IDS", "DIM", "ROWS", "BYTES", "EVICTIONS", "CAPACITY",
    ]  # fmt: skip
    user = ["user", "0", "0..499", "of", "1000", "8", "500", "15.6", "KiB", "-", "-"]
    assert lines[header + 1].split() == user
    item = ["item", "1", "hashed", "4", "100", "1.6", "KiB", "8", "100"]
    assert lines[header + 4].split() == item
    # Tables are not listed again as variables, nor counted in VARS.
    assert "user  " not in "\n".join(lines[header + 5 :])
    assert lines[1].split()[5] == "1"
    data = to_data(ADDRESSES[:2], statuses)["shards"][1]["tables"]
    assert data[0]["ids"] == [500, 1000] and data[1]["evictions"] == 8


def test_each_shards_data_port_is_shown_in_the_table_and_the_json() -> None:
    with_port = reply({0: 1}, live=[0])
    with_port.data_port = 7001
    statuses: list[Status] = [with_port, reply({0: 1}, live=[0]), "no answer"]
    text = render_table(ADDRESSES, statuses)
    assert "data ports (Arrow Flight, tensor bytes; none: on the gRPC port): " in text
    assert "shard 0 :7001, shard 1 none" in text
    shards = json.loads(render_json(ADDRESSES, statuses))["shards"]
    assert [s.get("data_port") for s in shards] == [7001, None, None]
