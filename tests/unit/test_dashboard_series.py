"""``psctl dashboard``'s data, without a network: the metrics it reads from Prometheus text,
the charts it builds from samples, the workers' report files, and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from psctl.dashboard import DashboardSources, ReportTail, Sample, build_series, parse_metrics
from psctl.main import main as psctl_main
from psctl.status_view import local_steps_of
from pswire.errors import ConfigError
from psworker.diloco import DiLoCoSettings
from psworker.reports import Reporter, StepLog, report, reporter_for

METRICS = """\
# TYPE psserver_push_bytes counter
psserver_push_bytes_total{shard="a",group="fc"} 100.0
psserver_push_bytes_total{shard="a",group="emb"} 50.0
# TYPE psserver_pull_bytes counter
psserver_pull_bytes_total{shard="a",group="fc"} 300.0
# TYPE psserver_rpcs counter
psserver_rpcs_total{shard="a",rpc="Push",code="OK"} 9.0
psserver_rpcs_total{shard="a",rpc="Push",code="INVALID_ARGUMENT"} 2.0
psserver_rpcs_total{shard="a",rpc="Init",code="UNAUTHENTICATED"} 1.0
# TYPE psserver_barrier_wait_seconds histogram
psserver_barrier_wait_seconds_bucket{shard="a",rpc="pull",le="+Inf"} 4.0
psserver_barrier_wait_seconds_sum{shard="a",rpc="pull"} 2.0
psserver_barrier_wait_seconds_count{shard="a",rpc="pull"} 4.0
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1048576.0
"""


def test_parse_metrics_sums_groups_and_counts_every_status_but_ok_as_refused() -> None:
    assert parse_metrics(METRICS) == {
        "bytes_in": 150.0,
        "bytes_out": 300.0,
        "refused": 3.0,
        "wait_sum": 2.0,
        "wait_count": 4.0,
        "rss": 1048576.0,
    }


def shard(**figures: float) -> dict:
    return {"error": None, "clock": 0, **figures}


def test_series_are_rates_per_interval_with_gaps_where_nothing_is_known() -> None:
    samples = [
        Sample(100.0, [shard(bytes_in=0, wait_sum=0, wait_count=0, refused=0, rss=2**20, spread=0)],
               {0: {"clock": 0, "staleness": 0, "loss": 2.0}, 1: {"clock": 0, "staleness": 0}}),
        Sample(102.0, [shard(bytes_in=2048, wait_sum=1.5, wait_count=3, refused=4, rss=2**21,
                             clock=8, spread=2)],
               {0: {"clock": 10, "staleness": 0, "loss": 1.0},
                1: {"clock": 6, "staleness": None, "rss": 3 * 2**20}}),
        Sample(103.0, [shard(bytes_in=0, wait_sum=1.5, wait_count=3, refused=4, clock=11)],
               {0: {"clock": 13, "staleness": 0}}),
    ]  # fmt: skip
    events = [{"t": 101.0, "text": "worker 1 left at step 6"}]
    data = build_series(samples, events, num_shards=1, window_s=0.0)  # rates per interval
    charts = {c["id"]: c for c in data["charts"]}
    assert data["t"] == [100.0, 102.0, 103.0] and data["steps"] == 13
    assert charts["steps"]["series"] == {
        "worker 0": [None, 5.0, 3.0],
        "worker 1": [None, 3.0, None],
        "shard 0 updates": [None, 4.0, 3.0],
    }
    assert charts["loss"]["series"]["worker 0"] == [2.0, 1.0, None]
    # KiB/s; the third sample's counter went down (a restarted shard): a gap, not a dip.
    assert charts["bytes_in"]["series"]["shard 0"] == [None, 1.0, None]
    assert charts["wait"]["series"]["shard 0"] == [None, 0.5, 0.0]  # mean seconds per call
    assert charts["refused"]["series"]["shard 0"] == [None, 2.0, 0.0]
    assert charts["staleness"]["series"]["worker 1"] == [0, None, None]
    assert charts["staleness"]["series"]["shard 0 spread"] == [0, 2, None]
    assert charts["rss"]["series"]["shard 0"] == [1.0, 2.0, None]
    assert charts["rss"]["series"]["worker 1"] == [None, 3.0, None]
    assert data["events"] == events and data["errors"] == []


def test_series_say_which_source_failed() -> None:
    sample = Sample(1.0, [{"error": "no answer within 5s"}, shard(metrics_error="refused")], {})
    data = build_series([sample], [], num_shards=2)
    assert data["errors"] == ["shard 0: no answer within 5s", "shard 1: refused"]
    assert data["steps"] == 0


def test_report_tail_reads_whole_new_lines_once(tmp_path: Path) -> None:
    path = tmp_path / "worker3.jsonl"
    path.write_text('{"worker": 3, "loss": 1.5}\n{"worker": 3, "lo')
    tail = ReportTail(tmp_path)
    assert tail.read() == [{"worker": 3, "loss": 1.5}]
    with path.open("a") as f:
        f.write('ss": 0.5}\nnot json\n')
    assert tail.read() == [{"worker": 3, "loss": 0.5}]
    assert tail.read() == []


def test_reporter_writes_numbers_and_refuses_anything_else(tmp_path: Path) -> None:
    reporter = Reporter(tmp_path, 2)
    reporter.write(7, {"loss": 0.25, "acc": math.nan})
    line = json.loads((tmp_path / "worker2.jsonl").read_text())
    assert (line["worker"], line["step"], line["loss"], line["acc"]) == (2, 7, 0.25, None)
    assert line["rss"] > 0
    with pytest.raises(ConfigError, match="'loss' must be a number, got list"):
        reporter.write(8, {"loss": [1.0]})
    with pytest.raises(ConfigError, match="'step' clashes"):
        reporter.write(8, {"step": 1.0})
    assert len((tmp_path / "worker2.jsonl").read_text().splitlines()) == 1  # nothing written
    reporter.close()


def test_report_goes_nowhere_without_a_folder(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    class Client:
        worker_id, step = 0, 4

    monkeypatch.delenv("PS_REPORT_DIR", raising=False)
    assert reporter_for(0) is None and report(Client(), loss=1.0) is False
    monkeypatch.setenv("PS_REPORT_DIR", str(tmp_path))
    assert report(Client(), loss=1.0) is True
    assert json.loads((tmp_path / "worker0.jsonl").read_text())["step"] == 4


def test_sources_refuse_a_metrics_list_of_another_length() -> None:
    with pytest.raises(ValueError, match="--metrics lists 1 addresses for 2 shards"):
        DashboardSources(("a:1", "b:2"), ("a:9",))
    with pytest.raises(ValueError, match="at least one shard"):
        DashboardSources(())


def test_psctl_dashboard_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        psctl_main(["dashboard", "127.0.0.1:1", "127.0.0.1:2", "--metrics", "127.0.0.1:9"])
    assert exit_.value.code == 2
    assert "--metrics lists 1 addresses for 2 shards" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        psctl_main(["dashboard", "127.0.0.1:1", "--port", "70000"])
    assert exit_.value.code == 2
    assert "--port must be in [0, 65535], got 70000" in capsys.readouterr().err


def test_rates_are_means_over_the_window_so_rare_steps_do_not_read_as_0_and_1() -> None:
    # An outer step every 2 s, sampled every second: per interval 0, 1, 0, 1 steps/s.
    clocks = [0, 0, 1, 1, 2, 2, 3, 3, 4]
    samples = [
        Sample(100.0 + i, [shard(clock=10 * c)], {0: {"clock": c}}) for i, c in enumerate(clocks)
    ]
    steps = next(c for c in build_series(samples, [], 1, window_s=4.0)["charts"])["series"]
    assert steps["worker 0"] == [None, 0.0, 0.5, 1 / 3, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert steps["shard 0 updates"][-1] == 5.0
    per_interval = build_series(samples, [], 1, window_s=0.0)["charts"][0]["series"]
    assert per_interval["worker 0"][1:] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_a_rate_skips_a_restarted_counter_and_a_worker_not_yet_known() -> None:
    samples = [
        Sample(100.0, [shard(bytes_in=4096)], {}),
        Sample(101.0, [shard(bytes_in=8192)], {0: {"clock": 5}}),
        Sample(102.0, [shard(bytes_in=1024)], {0: {"clock": 7}}),  # the shard restarted
        Sample(103.0, [shard(bytes_in=3072)], {0: {"clock": 9}}),
    ]
    charts = {c["id"]: c["series"] for c in build_series(samples, [], 1)["charts"]}
    # Within the window: from the first sample that knows the worker, from after the restart.
    assert charts["steps"]["worker 0"] == [None, None, 2.0, 2.0]
    assert charts["bytes_in"]["shard 0"] == [None, 4.0, None, 2.0]


def diloco_shard(**settings: object) -> dict:
    """A DiLoCo shard's figures, its settings read as psctl status reads what workers declare."""
    declared = DiLoCoSettings(**{"local_steps": 5, **settings}).variant("SGD[{lr=0.1}]")  # type: ignore[arg-type]
    return shard(diloco=local_steps_of("1dd2e9643d8c52fe" + declared))


def test_a_diloco_job_says_its_steps_are_outer_steps_and_its_bytes_pseudo_gradients() -> None:
    data = build_series([Sample(1.0, [diloco_shard()], {0: {"clock": 3}})], [], 1)
    charts = {c["id"]: c for c in data["charts"]}
    assert (data["steps"], data["step_unit"]) == (3, "outer steps")
    assert data["diloco"]["local_steps"] == 5
    assert charts["steps"]["unit"] == "outer steps/s"
    assert "each after H=5 inner steps" in charts["steps"]["title"]
    assert charts["staleness"]["unit"] == "outer steps"
    assert "pseudo-gradients" in charts["bytes_in"]["title"]
    dynamic = build_series(
        [Sample(1.0, [diloco_shard(outer_sync=False, dynamic_local_steps=True)], {})], [], 1
    )
    assert "each after up to H=5 inner steps" in dynamic["charts"][0]["title"]
    streaming = build_series([Sample(1.0, [diloco_shard(fragments=5)], {})], [], 1)
    assert "each after H/P=1 inner steps" in streaming["charts"][0]["title"]
    plain = build_series([Sample(1.0, [shard(diloco=None)], {0: {"clock": 3}})], [], 1)
    assert (plain["step_unit"], plain["diloco"]) == ("steps", None)
    assert plain["charts"][0]["unit"] == "steps/s"
    # A shard that does not answer does not hide what the others say.
    both = build_series([Sample(1.0, [{"error": "down"}, diloco_shard()], {})], [], 2)
    assert both["step_unit"] == "outer steps"


def test_an_empty_chart_says_what_would_fill_it() -> None:
    samples = [Sample(1.0, [shard()], {0: {"clock": 1, "live": True}})]
    bare = build_series(samples, [], 1, sources=DashboardSources(("a:1",)))
    notes = {c["id"]: c["note"] for c in bare["charts"]}
    assert "--reports" in notes["loss"] and "--reports" in notes["worker_bytes"]
    assert "--metrics" in notes["bytes_in"] and notes["steps"] is None
    full = DashboardSources(("a:1",), ("a:9",), Path("reports"))
    notes = {c["id"]: c["note"] for c in build_series(samples, [], 1, sources=full)["charts"]}
    assert "opt.report(loss=loss)" in notes["loss"] and notes["bytes_in"] is None
    samples[0].workers[0]["loss"] = 0.5
    notes = {c["id"]: c["note"] for c in build_series(samples, [], 1, sources=full)["charts"]}
    assert notes["loss"] is None


def test_the_workers_table_has_each_workers_clock_and_newest_report() -> None:
    samples = [Sample(1.0, [diloco_shard()], {0: {"clock": 3, "live": True}})]
    reported = {
        0: {"t": 0.5, "step": 15, "steps_per_s": 12.5, "bytes_sent": 644, "loss": 0.25},
        1: {"t": 0.4, "step": 10, "bytes_sent_total": 1288.0, "loss": math.inf},
    }
    rows = build_series(samples, [], 1, reported)["workers"]
    assert rows[0] == {
        "worker": 0, "clock": 3, "live": True, "step": 15, "steps_per_s": 12.5,
        "bytes_sent": 644, "bytes_received": None, "bytes_sent_total": None,
        "bytes_received_total": None, "loss": 0.25, "reported_at": 0.5,
    }  # fmt: skip
    # Known from its reports only (the shards have not heard of it): no clock, no liveness.
    assert (rows[1]["clock"], rows[1]["live"], rows[1]["step"]) == (None, None, 10)
    assert rows[1]["bytes_sent_total"] == 1288.0 and rows[1]["loss"] is None


def test_step_log_lines_carry_the_workers_step_the_pushed_step_and_its_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class Client:  # a DiLoCo client at its 2nd outer step: 10 inner steps finished
        worker_id, step = 5, 10

    monkeypatch.setenv("PS_REPORT_DIR", str(tmp_path))
    log = StepLog(Client(), report_every_s=3600.0)
    log.step(1, 0.01, sent=644, received=644)
    Client.step = 15
    log.step(2, 0.02, sent=322, received=644)  # held back: within the second of the first
    path = tmp_path / "worker5.jsonl"
    assert len(path.read_text().splitlines()) == 1
    log.flush()  # as when the log is collected or the process exits
    first, last = (json.loads(line) for line in path.read_text().splitlines())
    assert (first["step"], first["pushed_step"], first["bytes_sent"]) == (10, 1, 644)
    assert (last["step"], last["pushed_step"], last["bytes_sent"]) == (15, 2, 322)
    assert (last["bytes_sent_total"], last["bytes_received_total"]) == (966, 1288)
    log.flush()
    assert len(path.read_text().splitlines()) == 2  # nothing held: nothing more
