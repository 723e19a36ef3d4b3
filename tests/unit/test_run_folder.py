"""The run folder of a ``psctl local`` job: live exactly while its launcher holds the lock, and
``psctl local add`` / ``psctl status`` pick a job only when that choice is unambiguous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from psctl import local_add, run_folder
from psctl.run_folder import RUN_FILE, RunFolder


@pytest.fixture
def tmpdir_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$TMPDIR for this test only: other jobs on the machine are not seen."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    return tmp_path


def stale_folder(parent: Path, name: str, info: dict) -> Path:
    """A folder a killed launcher left behind: run.json, no lock held."""
    folder = parent / f"psctl-{name}"
    folder.mkdir()
    (folder / RUN_FILE).write_text(json.dumps(info))
    (folder / run_folder.LOCK_FILE).touch()
    return folder


def test_add_ignores_a_dead_job_whose_pid_is_reused(tmpdir_is: Path) -> None:
    # The launcher died by kill -9; its pid now belongs to another live process (this one).
    stale_folder(tmpdir_is, "dead", {"pid": os.getpid(), "elastic": "1:4", "shards": ["a:1"]})
    with pytest.raises(ValueError, match="no psctl local --elastic job is running"):
        local_add.find_run(None)
    live = RunFolder()
    try:
        live.publish(pid=os.getpid(), elastic="1:4", shards=["b:2"], mode="sync", workers=1)
        assert local_add.find_run(None) == live.path
    finally:
        live.remove()
    assert not live.path.exists()


def test_add_with_two_live_jobs_refuses_and_lists_both(tmpdir_is: Path) -> None:
    runs = [RunFolder() for _ in range(2)]
    try:
        for i, run in enumerate(runs):
            run.publish(elastic="1:4", shards=[f"127.0.0.1:{7000 + i}"], mode="sync", workers=1)
        with pytest.raises(ValueError, match="2 psctl local --elastic jobs are running") as err:
            local_add.find_run(None)
        for run in runs:
            assert f"--run {run.path}" in str(err.value)
        assert local_add.find_run(str(runs[1].path)) == runs[1].path  # --run picks one
    finally:
        for run in runs:
            run.remove()


def test_add_refuses_a_job_that_is_not_elastic(tmpdir_is: Path) -> None:
    run = RunFolder()
    try:
        run.publish(elastic=None, shards=["127.0.0.1:7000"], mode="sync", workers=2)
        with pytest.raises(ValueError, match="running, but not elastic") as err:
            local_add.find_run(None)
        assert str(run.path) in str(err.value)
        with pytest.raises(ValueError, match="is not elastic"):
            local_add.find_run(str(run.path))
    finally:
        run.remove()


def test_a_job_is_live_only_while_its_launcher_runs(tmp_path: Path) -> None:
    # Another process holds the lock; once it exits (however it ends), the job is not live.
    code = (
        "import sys, pathlib; from psctl.run_folder import RunFolder; "
        f"r = RunFolder(pathlib.Path({str(tmp_path)!r})); r.publish(shards=['x:1']); "
        "print(r.path, flush=True); sys.stdin.readline()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        folder = Path(proc.stdout.readline().strip())
        assert run_folder.is_live(folder)
        assert [r.folder for r in run_folder.live_runs(tmp_path)] == [folder]
        proc.kill()  # kill -9: no cleanup runs, the folder stays
        proc.wait(timeout=10)
        assert folder.exists() and not run_folder.is_live(folder)
        assert run_folder.live_runs(tmp_path) == []
        with pytest.raises(ValueError, match="no psctl local job is running"):
            run_folder.newest_run(tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_newest_run_is_the_last_started(tmp_path: Path) -> None:
    runs = [RunFolder(tmp_path) for _ in range(2)]
    try:
        runs[0].publish(started=100.0)
        runs[1].publish(started=200.0)
        assert run_folder.newest_run(tmp_path).folder == runs[1].path
    finally:
        for run in runs:
            run.remove()
