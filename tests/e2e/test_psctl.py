"""psctl as a subprocess: local clusters, exit-code propagation, the demo, status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Processes, child_env, free_port, pid_runs

import psworker

PSCTL = [sys.executable, "-m", "psctl.main"]

TRAIN = """
import os, sys
import numpy as np
import psworker

with psworker.connect() as client:
    assert client.num_workers == int(os.environ["PS_NUM_WORKERS"]) == 2
    assert client.worker_id == int(os.environ["PS_WORKER_ID"])
    assert client.mode == os.environ["PS_MODE"] == "sync"
    client.init({"w": np.zeros(4, np.float32)}, psworker.SGD(lr=0.5))
    for _ in range(3):
        client.pull()
        client.push({"w": np.full(4, client.worker_id + 1, np.float32)})
    w = client.pull()["w"]
    # Sync averages (1 + 2) / 2 = 1.5 per step; lr 0.5 takes 0.75 off per step.
    assert np.allclose(w, -2.25), w
    print(f"OK worker {client.worker_id} w={w[0]:.2f}")
"""

FAIL_ONE = """
import os, sys, threading
if os.environ["PS_WORKER_ID"] == "1":
    sys.exit(3)
print("worker 0 waiting", flush=True)
threading.Event().wait(60)  # a hung worker: psctl must stop it, not wait for it
"""

SHOW_ENV = """
import os
import psworker

with psworker.connect() as client:
    env = os.environ
    print(
        f"TF_CONFIG={env.get('TF_CONFIG')} PS_MODE={env['PS_MODE']} "
        f"id={env['PS_WORKER_ID']}/{env['PS_NUM_WORKERS']} client={type(client).__name__}"
    )
"""

HANG = """
import threading
print("ready", flush=True)
threading.Event().wait(60)
"""


def launched_pids(output: str) -> dict[str, int]:
    """Names and PIDs psctl reports for the processes it started."""
    found = re.findall(r"\[psctl\] (\w+) (?:serving at \S+|started) \(pid (\d+)\)", output)
    return {name: int(pid) for name, pid in found}


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def adopt_all(procs: Processes, output: str, script: Path) -> dict[str, int]:
    pids = launched_pids(output)
    for name, pid in pids.items():
        procs.adopt(pid, "psserver" if name.startswith("ps") else script.name)
    return pids


@pytest.mark.timeout(60)
def test_local_runs_workers_against_shards_and_prefixes_output(
    procs: Processes, tmp_path: Path
) -> None:
    script = write_script(tmp_path, "train_ok.py", TRAIN)
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--timeout", "45"]
    code, out = procs.run([*args, "--", sys.executable, str(script)], timeout=50)
    adopt_all(procs, out, script)
    assert code == 0, out
    assert "[worker0] OK worker 0 w=-2.25" in out
    assert "[worker1] OK worker 1 w=-2.25" in out
    assert re.search(r"^\[ps0\] .*psserver listening on 127\.0\.0\.1:\d+\b", out, re.M), out
    assert re.search(r"^\[ps1\] .*psserver stopped$", out, re.M), out


@pytest.mark.timeout(60)
def test_failing_worker_stops_the_rest_and_its_code_propagates(
    procs: Processes, tmp_path: Path
) -> None:
    script = write_script(tmp_path, "fail_one.py", FAIL_ONE)
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--grace", "2"]
    started = time.monotonic()
    code, out = procs.run([*args, "--", sys.executable, str(script)], timeout=50)
    pids = adopt_all(procs, out, script)
    assert code == 3, out
    assert "worker1 failed with exit code 3" in out
    assert time.monotonic() - started < 30, "psctl waited for the hung worker"
    assert sorted(pids) == ["ps0", "ps1", "worker0", "worker1"], out
    for name, pid in pids.items():
        marker = "psserver" if name.startswith("ps") else script.name
        assert not pid_runs(pid, marker), f"{name} (pid {pid}) outlived psctl"


@pytest.mark.timeout(60)
def test_overall_timeout_kills_everything(procs: Processes, tmp_path: Path) -> None:
    script = write_script(tmp_path, "hang.py", HANG)
    args = [*PSCTL, "local", "--workers", "2", "--timeout", "4", "--grace", "1"]
    code, out = procs.run([*args, "--", sys.executable, str(script)], timeout=40)
    pids = adopt_all(procs, out, script)
    assert code == 124, out
    assert "timed out" in out
    assert len(pids) == 3, out
    assert not any(pid_runs(pid, "hang.py") or pid_runs(pid, "psserver") for pid in pids.values())


@pytest.mark.timeout(60)
def test_sigterm_to_psctl_stops_its_children(procs: Processes, tmp_path: Path) -> None:
    script = write_script(tmp_path, "hang_term.py", HANG)
    args = [*PSCTL, "local", "--workers", "1", "--grace", "2"]
    proc = procs.start([*args, "--", sys.executable, str(script)])
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # bounded by the test timeout; the worker prints "ready" at once
        lines.append(line)
        if line.startswith("[worker0] ready"):
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=20)
    out = "".join(lines) + rest
    pids = adopt_all(procs, out, script)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM received" in out
    assert len(pids) == 2, out
    assert not pid_runs(pids["worker0"], script.name)
    assert not pid_runs(pids["ps0"], "psserver")


@pytest.mark.timeout(30)
def test_local_mode_takes_one_worker_only(procs: Processes) -> None:
    args = [*PSCTL, "local", "--mode", "local", "--workers", "2", "--", sys.executable, "-V"]
    code, out = procs.run(args, timeout=20)
    assert code == 2, out
    assert "--mode local runs one worker process, got --workers 2" in out


@pytest.mark.timeout(60)
def test_local_mode_runs_one_worker_without_cluster(procs: Processes, tmp_path: Path) -> None:
    script = write_script(tmp_path, "show_env.py", SHOW_ENV)
    args = [*PSCTL, "local", "--mode", "local", "--servers", "3", "--timeout", "40"]
    env = child_env(TF_CONFIG='{"cluster": {"ps": ["127.0.0.1:1"]}}')  # must not reach the worker
    code, out = procs.run([*args, "--", sys.executable, str(script)], timeout=45, env=env)
    pids = adopt_all(procs, out, script)
    assert code == 0, out
    assert sorted(pids) == ["worker0"], out  # no shards started
    assert "[worker0] TF_CONFIG=None PS_MODE=local id=0/1 client=LocalClient" in out


@pytest.mark.timeout(60)
def test_status_prints_table_and_json(procs: Processes) -> None:
    daemon = procs.psserver()
    with psworker.connect(
        [daemon.address], worker_id=0, num_workers=1, mode="ssp", staleness=2
    ) as client:
        client.init(
            {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)},
            psworker.SGD(lr=0.1),
        )
        for _ in range(2):
            client.push({"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)})

    code, table = procs.run([*PSCTL, "status", daemon.address], timeout=20)
    assert code == 0, table
    header, row = table.splitlines()[:2]
    assert header.split()[:8] == [
        "SHARD", "ADDRESS", "HEALTH", "MODE", "CLOCK", "VARS", "BYTES", "LIVE"
    ]  # fmt: skip
    assert row.split()[:10] == [
        "0", daemon.address, "SERVING", "ssp(2)", "2", "2", "60", "B", "0/1", "0"
    ]  # fmt: skip
    # The worker closed its client: it left the job (not dropped for silence).
    assert re.search(r"^0\s+2\s+0\s+left\s+\d+\.\ds ago$", table, re.M), table

    spec = json.dumps({"cluster": {"ps": [daemon.address], "worker": []}})
    code, text = procs.run([*PSCTL, "status", "--cluster", spec, "--json"], timeout=20)
    assert code == 0, text
    (shard,) = json.loads(text)["shards"]
    assert shard["address"] == daemon.address
    assert shard["health"] == "SERVING" and shard["initialized"] is True
    assert (shard["mode"], shard["staleness"], shard["clock"]) == ("ssp", 2, 2)
    assert (shard["num_variables"], shard["total_bytes"]) == (2, 60)
    assert [w["worker_id"] for w in shard["workers"]] == [0]
    assert shard["workers"][0]["clock"] == 2


@pytest.mark.timeout(30)
def test_status_of_unreachable_shard_fails(procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, text = procs.run(
        [*PSCTL, "status", "--json", "--timeout", "1", address], timeout=20, env=child_env()
    )
    assert code == 1, text
    (shard,) = json.loads(text)["shards"]
    assert shard["health"] == "UNREACHABLE" and shard["error"]


PUSH_TWO = """
import numpy as np
import psworker

with psworker.connect() as client:
    client.init({"w": np.zeros(1000, np.float32)}, psworker.SGD(lr=0.1))
    for _ in range(2):
        client.push({"w": np.ones(1000, np.float32)})
"""


@pytest.mark.timeout(90)
def test_checkpoint_dir_from_env_gives_each_shard_its_own_folder(
    procs: Processes, tmp_path: Path
) -> None:
    script = write_script(tmp_path, "push_two.py", PUSH_TWO)
    folder = tmp_path / "ckpt"
    env = child_env(PS_CHECKPOINT_DIR=str(folder))
    args = [*PSCTL, "local", "--servers", "2", "--workers", "1", "--timeout", "60"]
    code, out = procs.run([*args, "--", sys.executable, str(script)], timeout=80, env=env)
    adopt_all(procs, out, script)
    assert code == 0, out
    for i in range(2):
        assert f"[psctl] ps{i} checkpoints to {folder / f'ps{i}'}" in out
        # Each shard saved on SIGTERM into its own folder; before, ps1 was refused the one.
        assert sorted(p.name for p in (folder / f"ps{i}").glob("ckpt-*.safetensors")), out


@pytest.mark.timeout(30)
def test_status_of_a_refused_port_says_nothing_listens(procs: Processes) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, text = procs.run([*PSCTL, "status", address], timeout=20, env=child_env())
    assert code == 1, text
    assert "within 5s" not in text  # it did not wait 5 s: the port refused at once
    assert "Connection refused" in text and "nothing accepts connections there" in text


def test_status_into_a_reader_that_stops_early_ends_quietly(procs: Processes) -> None:
    """``psctl status | head -1``: the reader closes the pipe before psctl writes; psctl
    exits 0 with no traceback (a docs block runs it under ``set -o pipefail``)."""
    shard = procs.psserver()
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [*PSCTL, "status", shard.address],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr
