"""The psserver daemon as a subprocess: port file, health, signals, env twins, real training."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_support import (
    SERVING,
    Processes,
    child_env,
    free_port,
    health_status,
    pause,
    wait_port_file,
)

import psworker
from pswire.errors import WaitTimeoutError


@pytest.mark.timeout(30)
def test_serves_health_and_stops_gracefully_on_sigterm(procs: Processes, tmp_path: Path) -> None:
    port_file = tmp_path / "ps.port"
    daemon = procs.psserver("--port", "0", "--port-file", str(port_file), port_file=port_file)
    assert daemon.port > 0
    assert health_status(daemon.address, 10.0) == SERVING

    daemon.proc.send_signal(signal.SIGTERM)
    out, _ = daemon.proc.communicate(timeout=15)
    assert daemon.proc.returncode == 0, out
    assert f"psserver listening on 127.0.0.1:{daemon.port}" in out
    assert "psserver stopped" in out
    assert not port_file.exists(), "a stopped daemon must not leave its port file behind"


@pytest.mark.timeout(30)
def test_sigint_also_stops_with_code_zero(procs: Processes) -> None:
    daemon = procs.psserver("--grace", "0.5")
    daemon.proc.send_signal(signal.SIGINT)
    out, _ = daemon.proc.communicate(timeout=15)
    assert daemon.proc.returncode == 0, out


@pytest.mark.timeout(30)
def test_env_twins_set_port_and_port_file(procs: Processes, tmp_path: Path) -> None:
    port, port_file = free_port(), tmp_path / "from-env.port"
    env = child_env(PS_PORT=str(port), PS_PORT_FILE=str(port_file))
    daemon = procs.psserver(env=env, port_file=port_file)
    assert daemon.port == port
    assert health_status(f"127.0.0.1:{port}", 10.0) == SERVING


@pytest.mark.timeout(30)
def test_flag_wins_over_env_twin(procs: Processes) -> None:
    # A plain listener holds the port: gRPC binds with SO_REUSEPORT, so a second gRPC server
    # would share a port rather than fail on it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = child_env(PS_PORT=str(port))
        # Without the flag the variable is used, and the taken port fails the start plainly.
        code, out = procs.run(
            [sys.executable, "-m", "psserver", "--host", "127.0.0.1"], timeout=20, env=env
        )
        assert code == 1, out
        assert f"could not start on 127.0.0.1:{port}" in out
        # With the flag, the flag wins.
        daemon = procs.psserver("--port", "0", env=env)
        assert daemon.port != port


@pytest.mark.timeout(30)
def test_cluster_spec_names_the_port_of_this_ps_task(procs: Processes) -> None:
    mine = free_port()
    spec = {
        "cluster": {"ps": ["127.0.0.1:1", f"127.0.0.1:{mine}"], "worker": ["127.0.0.1:2"]},
        "task": {"type": "ps", "index": 1},
    }
    daemon = procs.psserver(env=child_env(TF_CONFIG=json.dumps(spec)))
    assert daemon.port == mine


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--threads", "0"], {}, "threads must be >= 1"),
        (["--max-wait", "-1"], {}, "max-wait must be > 0"),
        ([], {"PS_MAX_WORKERS": "many"}, "$PS_MAX_WORKERS='many' is not valid"),
        ([], {"PS_LOG_LEVEL": "LOUD"}, "$PS_LOG_LEVEL='LOUD' is not one of"),
        (
            ["--cluster", '{"cluster": {"ps": []}, "task": {"type": "ps", "index": 0}}'],
            {},
            "lists 0 ps addresses",
        ),
    ],
)
def test_bad_configuration_exits_with_usage_error(
    procs: Processes, flags: list[str], env: dict[str, str], message: str
) -> None:
    code, out = procs.run(
        [sys.executable, "-m", "psserver", *flags], timeout=20, env=child_env(**env)
    )
    assert code == 2, out
    assert message in out


@pytest.mark.timeout(60)
def test_sync_training_against_two_daemons_matches_numpy(procs: Processes) -> None:
    daemons = [procs.psserver(), procs.psserver()]
    addresses = [d.address for d in daemons]
    workers, steps, lr, momentum = 2, 4, 0.05, 0.9
    rng = np.random.default_rng(7)
    features = rng.standard_normal((workers, 16, 64)).astype(np.float32)
    targets = rng.standard_normal((workers, 16, 8)).astype(np.float32)
    initial = {
        "w": (0.1 * rng.standard_normal((64, 8))).astype(np.float32),
        "b": np.zeros(8, np.float32),
    }

    def grads(weights: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
        # Least squares on worker i's rows: the gradient depends on the weights, so any
        # mistake in averaging or ordering compounds over the steps.
        err = features[i] @ weights["w"] + weights["b"] - targets[i]
        return {"w": features[i].T @ err / len(err), "b": err.mean(axis=0)}

    results: dict[int, dict[str, np.ndarray]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            # split_bytes below w's 2 KiB: w is cut in rows across both daemons.
            with psworker.connect(
                addresses, worker_id=i, num_workers=workers, mode="sync", split_bytes=1024
            ) as client:
                client.init(initial, psworker.SGD(lr=lr, momentum=momentum))
                for _ in range(steps):
                    client.push(grads(client.pull(), i))
                results[i] = client.pull()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    assert not errors, errors
    assert sorted(results) == list(range(workers))

    expected: dict[str, np.ndarray] = {k: v.copy() for k, v in initial.items()}
    buffers: dict[str, np.ndarray] = {}
    for _ in range(steps):
        per_worker = [grads(expected, i) for i in range(workers)]
        for key in expected:
            mean = np.sum([g[key] for g in per_worker], axis=0) / np.float32(workers)
            buffers[key] = mean if key not in buffers else momentum * buffers[key] + mean
            expected[key] = expected[key] - lr * buffers[key]
    for i in range(workers):
        for key in expected:
            np.testing.assert_allclose(results[i][key], expected[key], rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected["w"], initial["w"]), "training must have moved the weights"


@pytest.mark.timeout(30)
def test_port_file_appears_only_once_serving(procs: Processes, tmp_path: Path) -> None:
    port_file = tmp_path / "late.port"
    proc = procs.start(
        [sys.executable, "-m", "psserver", "--host", "127.0.0.1", "--port-file", str(port_file)]
    )
    port = wait_port_file(proc, port_file, 20.0)
    # No wait_for_ready: the port file promises the server already accepts connections.
    assert health_status(f"127.0.0.1:{port}", 5.0, wait=False) == SERVING


@pytest.mark.timeout(60)
def test_a_frozen_shard_cannot_hang_a_step_and_the_step_counts_once(procs: Processes) -> None:
    daemon = procs.psserver()
    one = {"w": np.ones(4, np.float32)}
    with psworker.connect([daemon.address], mode="async", timeout=2.0, retry_s=0) as client:
        client.init({"w": np.zeros(4, np.float32)}, psworker.SGD(lr=1.0))
        client.push_pull(one)  # the step call is open now
        pause(daemon.proc.pid)  # alive, connected, silent
        try:
            start = time.monotonic()
            with pytest.raises(WaitTimeoutError, match=r"no reply within 2\.0s"):
                client.push_pull(one)
            waited = time.monotonic() - start
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert waited < 10
        # The same step again, on a new call: whether or not the frozen one reached the shard,
        # it is applied once.
        w = client.push_pull(one)["w"]
    np.testing.assert_array_equal(w, np.full(4, -2.0, np.float32))
