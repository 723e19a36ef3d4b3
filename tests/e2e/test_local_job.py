"""A running ``psctl local`` job from outside: ``psctl status`` with no address finds it through
the run folder the launcher prints, ``--watch`` follows it until it ends, and ``--export``
leaves the final model once every worker is done (async too, where no worker holds it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from e2e_support import REPO, Lines, Processes, child_env
from safetensors.numpy import load_file

PSCTL = [sys.executable, "-m", "psctl.main"]
ENV_WORKER = str(REPO / "tests" / "e2e" / "env_worker.py")


@pytest.mark.timeout(120)
def test_status_finds_the_running_job_and_watch_follows_it(
    procs: Processes, tmp_path: Path
) -> None:
    env = child_env(TMPDIR=str(tmp_path))
    args = [*PSCTL, "local", "--servers", "2", "--workers", "2", "--timeout", "100", "--"]
    job = Lines(
        procs.start([*args, sys.executable, ENV_WORKER, "--steps", "80", "--pace", "0.1"], env)
    )
    job.wait_for(lambda: '"step": 3' in job.text(), 60, "training")
    folder = re.search(r"\[psctl\] run folder (\S+)", job.text(last=10**6))
    assert folder is not None and Path(folder.group(1)).parent == tmp_path, job.text()
    code, out = procs.run([*PSCTL, "status"], timeout=30, env=env)
    assert code == 0, out
    assert f"job: {folder.group(1)}" in out and "mode sync" in out, out
    shards = re.findall(r"\[psctl\] ps\d serving at (\S+)", job.text(last=10**6))
    assert len(shards) == 2 and all(a in out for a in shards), out
    # --watch refreshes until the job ends, then says so and exits 0.
    code, out = procs.run([*PSCTL, "status", "--watch", "0.5"], timeout=100, env=env)
    assert code == 0, out
    assert out.count(f"job: {folder.group(1)}") >= 2, out
    assert out.rstrip().endswith(f"the job in {folder.group(1)} has ended"), out
    job.wait_for(lambda: job.proc.poll() is not None, 30, "the job's end")
    assert job.proc.returncode == 0, job.text()


def test_status_with_no_job_and_no_address_says_so(procs: Processes, tmp_path: Path) -> None:
    code, out = procs.run([*PSCTL, "status"], timeout=30, env=child_env(TMPDIR=str(tmp_path)))
    assert code == 2, out
    assert "no psctl local job is running on this machine" in out, out


@pytest.mark.timeout(120)
def test_export_writes_the_final_async_model(procs: Processes, tmp_path: Path) -> None:
    out_dir = tmp_path / "workers"
    out_dir.mkdir()
    export = tmp_path / "final.safetensors"
    args = [*PSCTL, "local", "--mode", "async", "--servers", "2", "--workers", "2"]
    args += ["--timeout", "100", "--export", str(export), "--"]
    worker = [sys.executable, ENV_WORKER, "--steps", "20", "--out", str(out_dir)]
    code, out = procs.run([*args, *worker], timeout=110, env=child_env(TMPDIR=str(tmp_path)))
    assert code == 0, out
    assert f"to {export}" in out and "exported the final model" in out, out
    model = load_file(export)
    finals = []
    for w in (0, 1):
        with np.load(out_dir / f"worker{w}.npz") as data:
            finals.append({k: data[k] for k in data.files})
    # The worker that pulled last saw every push: the exported model is its final pull.
    assert any(all(np.array_equal(model[k], final[k]) for k in final) for final in finals), (
        "the export is neither worker's final model"
    )
    assert sorted(model) == ["v0", "v1"]


def test_add_help_promises_the_run_folder_the_launcher_prints(
    procs: Processes, tmp_path: Path
) -> None:
    env = child_env(TMPDIR=str(tmp_path))
    args = [*PSCTL, "local", "--mode", "local", "--", sys.executable, "-c", "pass"]
    code, out = procs.run(args, timeout=60, env=env)
    assert code == 0, out
    printed = re.search(r"^\[psctl\] run folder (\S+) ", out, re.M)
    assert printed is not None, out
    assert not Path(printed.group(1)).exists()  # removed when the job ends
    code, help_text = procs.run([*PSCTL, "local", "add", "--help"], timeout=30, env=env)
    assert code == 0 and "prints it as `run folder ...`" in " ".join(help_text.split())
