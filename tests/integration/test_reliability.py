"""What a worker and real shards do so that no fault ends silently with another model (issue
14, 17): job identity across checkpoints, late pushes, pushes that cannot half-apply, one
process per worker id, leaving at the end, a bounded replay log and ring mailbox, temp files
cleaned, dropped workers reported."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import time
import types
from pathlib import Path

import grpc
import numpy as np
import pytest

import psworker
from pscore.optim import SGD
from pscore.tables import RowSparse, Table
from psserver.checkpoint import Checkpointer, CheckpointScheduler
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.channel import insecure_channel
from pswire.errors import (
    ConfigError,
    DuplicateWorkerError,
    ModelMismatchError,
    ShapeMismatchError,
    TooLargeError,
    WorkerDroppedError,
)
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.write import tensor_to_chunks

SHAPES = {"w": (8, 4), "b": (4,)}


def values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def ones(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: np.full(s, scale, np.float32) for k, s in SHAPES.items()}


def durable_shard(directory: Path, port: int = 0) -> tuple[RunningServer, CheckpointScheduler]:
    """A shard that checkpoints into ``directory`` and restores its newest checkpoint."""
    shard = Shard(Limits(max_wait_s=10))
    saver = CheckpointScheduler(shard, Checkpointer(directory))
    saver.resume()
    return start_server(shard, port=port, checkpoint=saver.checkpoint), saver


# -- item 1: a checkpoint of another job -----------------------------------------------------


def test_a_shard_restored_from_another_runs_checkpoint_is_refused_naming_both_jobs(tmp_path):
    # Run B (another seed) leaves a checkpoint with the same shapes and a later clock.
    other, saver = durable_shard(tmp_path / "b")
    with psworker.connect([other.address], mode="async", timeout=10) as client:
        client.init(values(seed=9), SGD(lr=0.1))
        for _ in range(5):
            client.push(ones())
        other_job = client.identity.value
    saver.checkpoint()
    other.stop(grace=0)

    server, saver = durable_shard(tmp_path / "a")
    port = int(server.address.rsplit(":", 1)[1])
    with psworker.connect([server.address], mode="async", timeout=10, retry_s=10) as client:
        client.init(values(seed=1), SGD(lr=0.1))
        client.push(ones())
        saver.checkpoint()
        mine = client.identity.value
        server.stop(grace=0)  # the shard comes back on run B's folder
        (tmp_path / "a").rename(tmp_path / "a-old")
        (tmp_path / "b").rename(tmp_path / "a")
        server, _ = durable_shard(tmp_path / "a", port)
        try:
            with pytest.raises(
                ModelMismatchError, match=rf"holds job {other_job}.*trains job {mine}"
            ):
                client.push(ones())
        finally:
            server.stop(grace=0)


def test_worker_0_refuses_to_initialise_empty_shards_beside_trained_ones(tmp_path):
    trained, _ = durable_shard(tmp_path / "a")
    with psworker.connect([trained.address], mode="async", timeout=10) as client:
        client.init({"w": np.zeros(4, np.float32)}, SGD(lr=0.1))
        client.push({"w": np.ones(4, np.float32)})
    empty = start_server(Shard())
    try:
        addresses = [trained.address, empty.address]
        client = psworker.connect(addresses, mode="async", timeout=10)
        with client, pytest.raises(ModelMismatchError, match=r"shards \[1\] hold none"):
            client.init({"w": np.zeros(4, np.float32)}, SGD(lr=0.1))
        assert not empty.shard.status().initialized
    finally:
        trained.stop(grace=0)
        empty.stop(grace=0)


# -- items 3, 17.2: a worker dropped from the quorum finds out -------------------------------


def test_a_late_sync_push_raises_without_backup_workers_and_the_others_are_told(shards, caplog):
    (server,) = shards(1, Limits(max_wait_s=10, heartbeat_timeout_s=0.5))
    address = [server.address]
    slow = psworker.connect(address, worker_id=1, num_workers=2, mode="sync", heartbeat_s=0)
    fast = psworker.connect(address, worker_id=0, num_workers=2, mode="sync", heartbeat_s=0.1)
    with slow, fast:
        slow.init(values(), SGD(lr=0.1))
        fast.init(values(), SGD(lr=0.1))
        with caplog.at_level(logging.WARNING, logger="psworker.client"):
            fast.push_pull(ones())  # waits ~0.5 s for worker 1, which is then dropped
            fast.push_pull(ones())
        assert fast.absent == {1}
        assert "workers [1] are out of the quorum" in caplog.text
        with pytest.raises(WorkerDroppedError, match=r"step 0 arrived after that step closed"):
            slow.push(ones())  # step 0 closed long ago without it


def test_a_late_push_with_backup_workers_is_a_warning_and_the_worker_moves_on(shards, caplog):
    (server,) = shards(1, Limits(max_wait_s=10))
    address = [server.address]
    with (
        psworker.connect(address, worker_id=0, num_workers=2, mode="sync", quorum=1) as a,
        psworker.connect(address, worker_id=1, num_workers=2, mode="sync", quorum=1) as b,
    ):
        a.init(values(), SGD(lr=0.1))
        b.init(values(), SGD(lr=0.1))
        a.push_pull(ones())
        a.push_pull(ones())
        with caplog.at_level(logging.WARNING, logger="psworker.client"):
            assert b.push(ones()) is False  # step 0 closed with worker 0's push alone
        assert "came after its step closed" in caplog.text and b.step == 2


# -- item 6: a push never half-applies unnoticed --------------------------------------------


def test_everything_a_worker_can_check_is_checked_before_any_shard_hears_of_the_push(shards):
    servers = shards(2)
    with psworker.connect([s.address for s in servers], mode="async") as client:
        client.init(values(), SGD(lr=0.1), tables={"t": Table(10, 4)})
        bad_shape = {"w": np.ones((4, 8), np.float32), "b": np.ones(4, np.float32)}
        nan_row = RowSparse([1, 7], np.array([[1, 1, 1, 1], [1, np.nan, 1, 1]], np.float32))
        for bad, error in [
            (bad_shape, ShapeMismatchError),
            ({**ones(), "t": nan_row}, psworker.InvalidRequestError),
            ({**ones(), "t": RowSparse([1, 12], np.ones((2, 4), np.float32))}, Exception),
        ]:
            with pytest.raises(error):
                client.push(bad)
        assert [s.shard.status().pushes_applied for s in servers] == [0, 0]
        assert client.push(ones()) is True  # the step was never used: applied everywhere
        assert [s.shard.status().pushes_applied for s in servers] == [1, 1]


def test_a_push_one_shard_refuses_after_another_took_it_uses_the_step_up(shards):
    big, small = shards(1)[0], shards(1, Limits(max_request_bytes=64))[0]
    with psworker.connect([big.address, small.address], mode="async") as client:
        client.init(values(), SGD(lr=0.1))  # w (128 B) on shard 0, b (16 B) on shard 1
        small.shard.limits = Limits(max_request_bytes=8)  # now shard 1 refuses b
        with pytest.raises(TooLargeError, match=r"step 0 was taken by shards \[0\]"):
            client.push(ones())
        assert client.step == 1
        small.shard.limits = Limits()
        assert client.push(ones()) is True  # step 1: no shard calls it a duplicate


# -- item 7: one process per worker id -------------------------------------------------------


def test_several_workers_need_ids_and_a_second_process_cannot_take_a_live_ones(shards):
    (server,) = shards(1, Limits(claim_grace_s=1.0))
    with pytest.raises(ConfigError, match="needs each worker's id"):
        psworker.connect([server.address], num_workers=2)
    first = psworker.connect(
        [server.address], worker_id=0, num_workers=1, mode="async", heartbeat_s=0.2
    )
    with first:
        first.init(values(), SGD(lr=0.1))
        second = psworker.connect(
            [server.address], worker_id=0, num_workers=1, mode="async", retry_s=3
        )
        with second, pytest.raises(DuplicateWorkerError, match="held by another live client"):
            second.init(values(), SGD(lr=0.1))
        first.push(ones())
        first._beats.stop()  # the first process "dies": silent, no goodbye
        third = psworker.connect(
            [server.address], worker_id=0, num_workers=1, mode="async", retry_s=10
        )
        with third:
            third.init(values(), SGD(lr=0.1))  # takes over once the claim lapses
            assert third.step == 1 and third.push(ones())


# -- item 8: a finished worker leaves -------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_sync_worker_that_never_starts_is_dropped_under_a_short_heartbeat_timeout(shards):
    # 3 s: under the clients' default 2 s beat, a shard used to take each gap between two of
    # worker 0's beats for its own stall (it heard nobody for half the timeout) and never
    # dropped worker 1, so worker 0 waited out its whole timeout.
    (server,) = shards(1, Limits(max_wait_s=60, heartbeat_timeout_s=3))
    with psworker.connect([server.address], worker_id=0, num_workers=2, timeout=30) as alone:
        alone.init(values(), SGD(lr=0.1))
        start = time.monotonic()
        alone.push_pull(ones())
        assert time.monotonic() - start < 15
        assert alone.absent == {1}  # the step's result says who was missing
    assert 1 not in server.shard.status().live


def test_in_ssp_the_last_worker_does_not_wait_for_one_that_finished(shards):
    (server,) = shards(1, Limits(max_wait_s=60, heartbeat_timeout_s=60))
    address = [server.address]
    early = psworker.connect(address, worker_id=0, num_workers=2, mode="ssp", staleness=1)
    late = psworker.connect(address, worker_id=1, num_workers=2, mode="ssp", staleness=1)
    with late:
        with early:
            early.init(values(), SGD(lr=0.1))
            late.init(values(), SGD(lr=0.1))
            for _ in range(3):
                early.push_pull(ones())
                late.push_pull(ones())
        start = time.monotonic()
        for _ in range(3):  # beyond the finished worker's steps: ssp would gate on it
            late.push_pull(ones())
        assert time.monotonic() - start < 10  # it used to wait out the heartbeat timeout
    assert server.shard.status().left == {0, 1}


def test_a_worker_process_that_exits_without_close_leaves_the_job(shards):
    (server,) = shards(1, Limits(max_wait_s=60, heartbeat_timeout_s=60))
    script = (
        "import sys, numpy as np, psworker\n"
        "from pscore.optim import SGD\n"
        "c = psworker.connect([sys.argv[1]], worker_id=1, num_workers=2, mode='ssp', staleness=1)\n"
        "c.init({'w': np.zeros(4, np.float32)}, SGD(lr=0.1))\n"
        "c.push_pull({'w': np.ones(4, np.float32)})\n"  # no close(): the script just ends
    )
    with psworker.connect(
        [server.address], worker_id=0, num_workers=2, mode="ssp", staleness=1
    ) as first:
        first.init({"w": np.zeros(4, np.float32)}, SGD(lr=0.1))
        done = subprocess.run(
            [sys.executable, "-c", script, server.address], timeout=60, capture_output=True
        )
        assert done.returncode == 0, done.stderr.decode()
        assert server.shard.status().left == {1}  # said at exit, not found by a timeout
        start = time.monotonic()
        for _ in range(4):  # beyond worker 1's step + staleness: ssp would gate on it
            first.push_pull({"w": np.ones(4, np.float32)})
        assert time.monotonic() - start < 10


# -- items 12, 13, 14, 15 --------------------------------------------------------------------


def test_a_ring_rank_files_only_its_current_and_next_collective():
    import pyarrow.flight as flight

    from pswire import flightwire
    from psworker.ring.flight_transport import COMMAND, DATA, RingServer, dtype_code, encode_header
    from psworker.ring.peer import Tag

    server = RingServer(max_buffered_bytes=1 << 20)
    chunk = np.ones(1024, np.float32)
    descriptor = flight.FlightDescriptor.for_command(COMMAND)

    def send(ops_and_tags):
        """Streams chunks on one DoPut; the server's verdict as a PSError, or None."""
        client = flight.FlightClient(f"grpc+tcp://{server.address}")
        try:
            writer, _ = client.do_put(descriptor, flightwire.SCHEMA)
            for op, tag in ops_and_tags:
                header = encode_header(DATA, op, 0, tag, dtype_code(chunk.dtype))
                writer.write_with_metadata(flightwire.as_batch(chunk), header)
            writer.done_writing()
            writer.close()
        except flight.FlightError as exc:
            return flightwire.from_flight_error(exc)
        finally:
            client.close()
        return None

    try:
        assert send([(1, Tag(0, 0, 0))]) is None  # the next collective: filed
        far = send([(7, Tag(0, 0, 0))])
        assert far is not None and far.status == "INVALID_ARGUMENT"
        assert "takes only collectives 0 and 1" in str(far)
        full = send((0, Tag(0, 0, i)) for i in range(400))  # 1.6 MB
        assert full is not None and full.status == "RESOURCE_EXHAUSTED"
    finally:
        server.stop()


def test_a_rejected_push_leaves_no_reference_cycle_holding_its_arrays(shards):
    (server,) = shards(1, Limits(max_wait_s=5))
    with psworker.connect([server.address], mode="async") as client:
        client.init({"w": np.zeros(1 << 20, np.float32)}, SGD(lr=0.1))
    stub = ps_pb2_grpc.ParameterServerStub(insecure_channel(server.address))
    bad = np.full(1 << 20, np.nan, np.float32)  # 4 MiB, refused: not finite
    header = ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=0, step=0))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            chunks = [ps_pb2.PushRequest(chunk=c) for c in tensor_to_chunks("w", bad)]
            with pytest.raises(grpc.RpcError):
                stub.Push(iter([header, *chunks]), timeout=5)
        time.sleep(0.2)
        gc.collect()
        # A cycle through a kept exception holds the failed call's frames, and with them the
        # request's decoded arrays, until the collector runs: none may be found.
        ours = [
            o.f_code.co_filename
            for o in gc.garbage
            if isinstance(o, types.FrameType) and "/psserver/" in o.f_code.co_filename
        ]
        assert ours == [], f"frames freed only by the cycle collector: {sorted(set(ours))}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_the_replay_log_stays_bounded_by_asking_the_shard_to_checkpoint(tmp_path):
    server, _ = durable_shard(tmp_path)
    model = {"w": np.zeros(1 << 16, np.float32)}  # 256 KiB a push
    try:
        with psworker.connect(
            [server.address], mode="async", replay_bytes=1 << 20, heartbeat_s=0
        ) as client:
            client.init(model, SGD(lr=0.1))
            for _ in range(40):  # 10 MiB of pushes
                client.push({"w": np.ones(1 << 16, np.float32)})
                assert client.links[0].log_bytes <= (1 << 20) + (1 << 18)
            assert server.shard.status().checkpoint_step > 0
    finally:
        server.stop(grace=0)


def test_a_full_replay_log_fails_loudly_when_the_shard_cannot_checkpoint(tmp_path):
    server, saver = durable_shard(tmp_path / "ckpt")
    try:
        with psworker.connect(
            [server.address], mode="async", replay_bytes=1 << 20, heartbeat_s=0
        ) as client:
            client.init({"w": np.zeros(1 << 16, np.float32)}, SGD(lr=0.1))
            saver.checkpointer.directory = tmp_path / "not-a-folder"
            (tmp_path / "not-a-folder").write_text("a file where the folder should be")
            with pytest.raises(TooLargeError, match="could not checkpoint"):
                for _ in range(40):
                    client.push({"w": np.ones(1 << 16, np.float32)})
    finally:
        server.stop(grace=0)


def test_restart_removes_every_temp_file_a_killed_save_can_leave(tmp_path):
    for name in (".tmpAb12Cd", ".ckpt-x1y2.tmp", ".tmpfoo", "notes.txt"):
        (tmp_path / name).write_bytes(b"x" * 10)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.lock()
    try:
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == [".lock", ".tmpfoo", "notes.txt"]  # not ours: kept
    finally:
        checkpointer.unlock()


def test_requests_arriving_at_once_are_bounded_in_total_and_released_when_they_end():
    from psserver.admission import Admission

    admission = Admission(threads=16, max_inflight_bytes=1000)
    with admission.inflight() as first:
        first(600)
        with admission.inflight() as second, pytest.raises(psworker.PSError, match="limit of 1000"):
            second(600)  # together they would pass the bound
    with admission.inflight() as third:
        third(1000)  # both ended: everything was released

    server = start_server(Shard(Limits(max_wait_s=5)), max_inflight_bytes=1 << 20)
    try:
        with psworker.connect([server.address], mode="async", chunk_bytes=1 << 16) as client:
            client.init({"w": np.zeros(1 << 18, np.float32)}, SGD(lr=0.1))  # 1 MiB: fits
            with pytest.raises(psworker.PSError, match="max-inflight-bytes") as busy:
                client.init({"w": np.zeros(1 << 19, np.float32)}, SGD(lr=0.1))
            assert type(busy.value).__name__ == "ShardBusyError"
            assert client.push({"w": np.ones(1 << 18, np.float32)})  # 1 MiB again: released
    finally:
        server.stop(grace=0)
