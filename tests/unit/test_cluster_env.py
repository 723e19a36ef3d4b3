"""A pod's task from its environment: one TF_CONFIG shared by every pod, an index each."""

from __future__ import annotations

import json
import os

import pytest

from psserver.config import parse_config
from pswire.cluster import ClusterSpec, task_index_from_env
from psworker.main import export_job
from psworker.session import MIN_HEARTBEAT_S, Heartbeats

SHARED = json.dumps({"cluster": {"ps": ["ps-0.ps:7000", "ps-1.ps:7001"], "worker": ["a", "b"]}})
INDEX_VARS = ("PS_TASK_INDEX", "JOB_COMPLETION_INDEX")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*INDEX_VARS, "TF_CONFIG"] + [k for k in os.environ if k.startswith("PS_")]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("socket.gethostname", lambda: "laptop")


@pytest.mark.parametrize(
    ("env", "hostname", "expected"),
    [
        ({"PS_TASK_INDEX": "3", "JOB_COMPLETION_INDEX": "1"}, "ps-7", 3),
        ({"JOB_COMPLETION_INDEX": "1"}, "ps-7", 1),
        ({"PS_TASK_INDEX": ""}, "ps-7", 7),  # empty: unset, as an absent downward-API label
        ({}, "my-shards-12", 12),
        ({}, "ps0", None),  # Compose-style names carry no ordinal
        ({}, "3f2a1b9c0d4e", None),  # a container id
        ({}, "ps-", None),
    ],
)
def test_task_index_precedence(env: dict[str, str], hostname: str, expected: int | None) -> None:
    assert task_index_from_env(env, hostname) == expected


@pytest.mark.parametrize("bad", ["-1", "x", "1.5"])
def test_a_bad_index_names_its_variable(bad: str) -> None:
    with pytest.raises(ValueError, match=r"\$PS_TASK_INDEX="):
        task_index_from_env({"PS_TASK_INDEX": bad}, "ps-0")


def test_spec_without_task_takes_role_and_index_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_TASK_INDEX", "1")
    spec = ClusterSpec.parse(SHARED, role="ps")
    assert (spec.task_type, spec.task_index) == ("ps", 1)
    # An explicit task wins over the environment.
    explicit = json.dumps({**json.loads(SHARED), "task": {"type": "worker", "index": 0}})
    assert ClusterSpec.parse(explicit, role="ps").task_type == "worker"
    # Without a role the old meaning stays: worker 0.
    assert ClusterSpec.parse(SHARED).task_index == 0


def test_spec_without_task_or_index_says_where_to_put_one() -> None:
    with pytest.raises(ValueError, match=r"PS_TASK_INDEX.*JOB_COMPLETION_INDEX"):
        ClusterSpec.parse(SHARED, role="worker")


def test_psserver_binds_its_statefulset_ordinals_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", SHARED)
    monkeypatch.setattr("socket.gethostname", lambda: "ps-1")
    config = parse_config([])
    assert (config.port, config.shard_name) == (7001, "ps1")
    assert config.metrics_port is None and config.log_format == "text"


def test_psserver_metrics_and_log_format_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_METRICS_PORT", "9100")
    monkeypatch.setenv("PS_LOG_FORMAT", "json")
    config = parse_config(["--port", "0", "--shard-name", "east"])
    assert (config.metrics_port, config.log_format, config.shard_name) == (9100, "json", "east")
    assert parse_config(["--metrics-port", "0"]).metrics_port is None  # 0: off
    with pytest.raises(SystemExit):
        parse_config(["--log-format", "xml"])
    with pytest.raises(SystemExit):
        parse_config(["--metrics-port", "70000"])


def test_psworker_run_exports_the_task_it_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", SHARED)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    spec = export_job(None, "sync", None)
    assert (spec.task_type, spec.task_index) == ("worker", 1)
    # connect() in the entry point re-reads TF_CONFIG: it must name the same task.
    exported = json.loads(os.environ["TF_CONFIG"])
    assert exported["task"] == {"type": "worker", "index": 1}
    assert exported["cluster"]["ps"] == ["ps-0.ps:7000", "ps-1.ps:7001"]
    assert os.environ["PS_WORKER_ID"] == "1"


def test_psserver_refuses_a_heartbeat_timeout_under_a_second_but_takes_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_config(["--heartbeat-timeout", "0"]).limits.heartbeat_timeout_s == 0
    assert parse_config(["--heartbeat-timeout", "1"]).limits.heartbeat_timeout_s == 1
    for bad in ("0.01", "0.99", "-1"):
        with pytest.raises(SystemExit):
            parse_config(["--heartbeat-timeout", bad])
        assert (
            "heartbeat-timeout must be 0 (never drop a worker) or >= 1 seconds, got "
            f"{float(bad)} (workers beat four times per timeout)"
        ) in capsys.readouterr().err


def test_workers_beat_four_times_per_shard_timeout_but_at_most_every_50_ms() -> None:
    for shard_timeout, interval in ((0.0, 2.0), (8.0, 2.0), (2.0, 0.5), (0.1, 0.05), (0.01, 0.05)):
        beats = Heartbeats([], 2.0, worker=0, session="s")
        beats.start(shard_timeout)
        beats.stop()
        assert beats.interval == pytest.approx(interval), shard_timeout
    assert MIN_HEARTBEAT_S == 0.05
