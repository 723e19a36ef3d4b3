"""The psserver daemon's checkpoints: periodic, on request, on SIGTERM; resume; kill -9 safety."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from e2e_support import Processes, child_env

import psworker
from psctl.admin import checkpoint_all, export_state_dict
from psserver.checkpoint import Checkpointer, checkpoint_name
from psworker.link import shard_status as status


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Polls ``condition`` until it holds, failing the test with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"within {timeout}s: {what}")
        time.sleep(0.01)


def model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((16, 4)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
    }


def grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model(0).items()}


def stop(procs: Processes, daemon) -> str:
    daemon.proc.send_signal(signal.SIGTERM)
    out, _ = daemon.proc.communicate(timeout=15)
    assert daemon.proc.returncode == 0, out
    return out


@pytest.mark.timeout(30)
def test_sigterm_saves_a_final_checkpoint_and_a_restart_resumes_from_it(
    procs: Processes, tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt_dir), "--checkpoint-every-steps", "2")
    first = procs.psserver("--port", "0", *flags)
    optimizer = psworker.Adam(lr=0.05)
    with psworker.connect([first.address], worker_id=0, num_workers=1, mode="sync") as client:
        client.init(model(0), optimizer)
        for step in range(2):
            client.push(grads(step))
        wait_until(
            lambda: (ckpt_dir / checkpoint_name(2)).exists(), 10, "periodic checkpoint at step 2"
        )
        [saved] = checkpoint_all([first.address], timeout=10)
        assert (Path(saved.path), saved.step) == (ckpt_dir / checkpoint_name(2), 2)
        client.push(grads(2))  # clock 3: not a multiple of 2, so only SIGTERM saves it
        weights = client.pull()
    assert not (ckpt_dir / checkpoint_name(3)).exists()
    out = stop(procs, first)
    assert "checkpoint at shard clock 3 written" in out
    latest = Checkpointer(ckpt_dir).load_latest()
    assert latest is not None and latest.updates == 3

    second = procs.psserver("--port", "0", *flags)
    [st] = status([second.address], timeout=10)
    assert (st.clock, st.checkpoint_step, st.initialized) == (3, 3, True)
    with psworker.connect([second.address], worker_id=0, num_workers=1, mode="sync") as client:
        client.init(model(1), optimizer)  # other values: a restored shard keeps its own
        assert client.step == 3, "the worker resumes at the restored clock"
        resumed = client.pull()
        for key, value in weights.items():
            assert resumed[key].tobytes() == value.tobytes(), key
        client.push(grads(3))
        after = client.pull()
    done = export_state_dict([second.address], tmp_path / "model.safetensors", timeout=10)
    assert done.clocks == [4]
    for key, value in after.items():
        np.testing.assert_array_equal(done.tensors[key], value)
    out = stop(procs, second)
    assert "restored from checkpoint" in out and "shard clock 3" in out


@pytest.mark.timeout(30)
def test_kill_9_mid_run_keeps_the_last_good_checkpoint_loadable(
    procs: Processes, tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt_dir), "--checkpoint-every-steps", "1")
    daemon = procs.psserver("--port", "0", *flags, "--keep-checkpoints", "2")
    # 16 MiB of weights: a save takes long enough that the kill often lands mid-write.
    big = {"w": np.zeros((1024, 4096), np.float32)}
    halt = threading.Event()

    def train() -> None:
        with psworker.connect(
            [daemon.address], worker_id=0, num_workers=1, mode="async", timeout=2
        ) as client:
            client.init(big, psworker.SGD(lr=0.01))
            one = {"w": np.ones_like(big["w"])}
            while not halt.is_set():
                try:
                    client.push(one)
                except psworker.PSError:
                    return  # the daemon is gone

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        wait_until(lambda: len(Checkpointer(ckpt_dir).paths()) >= 2, 15, "two checkpoints")
        # Kill while a save is in flight when one is caught within the window.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not any(ckpt_dir.glob(".ckpt-*.tmp")):
            time.sleep(0.001)
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(timeout=10)
    finally:
        halt.set()
        trainer.join(10)
    assert daemon.proc.returncode == -signal.SIGKILL

    ckpt = Checkpointer(ckpt_dir)
    newest = ckpt.paths()[0]
    state = ckpt.load(newest)  # a torn write never takes a checkpoint's name
    assert state.updates >= 1
    # Every applied push subtracted lr * 1 once: the weights match the clock they claim.
    np.testing.assert_allclose(state.variables["w"], -0.01 * state.updates, rtol=1e-4)

    restarted = procs.psserver("--port", "0", *flags)
    [st] = status([restarted.address], timeout=10)
    assert st.clock == state.updates
    assert not list(ckpt_dir.glob(".ckpt-*.tmp")), "the restart clears the torn temp file"
    weights = export_state_dict([restarted.address], tmp_path / "m.safetensors", timeout=10)
    np.testing.assert_array_equal(weights.tensors["w"], state.variables["w"])


@pytest.mark.timeout(30)
def test_env_twins_and_one_daemon_per_directory(procs: Processes, tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "shared"
    env = child_env(PS_CHECKPOINT_DIR=str(ckpt_dir), PS_CHECKPOINT_EVERY_STEPS="1")
    daemon = procs.psserver("--port", "0", env=env)
    with psworker.connect([daemon.address], worker_id=0, num_workers=1, mode="sync") as client:
        client.init(model(0), psworker.SGD(lr=0.1))
        client.push(grads(0))
    wait_until(lambda: (ckpt_dir / checkpoint_name(1)).exists(), 10, "checkpoint via PS_* twins")

    code, out = procs.run(
        [sys.executable, "-m", "psserver", "--host", "127.0.0.1", "--port", "0"], 20, env=env
    )
    assert code == 1, out
    assert "in use by another process" in out

    code, out = procs.run(
        [sys.executable, "-m", "psserver", "--checkpoint-every-secs", "5"], 20, env=child_env()
    )
    assert code == 2, out
    assert "checkpoint intervals need a checkpoint-dir" in out
