"""``psworker run`` as a subprocess: a module:function or a script trains as a cluster worker."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from e2e_support import Processes, child_env

PSWORKER = [sys.executable, "-m", "psworker"]

JOB = """
import json, os, sys
import numpy as np
import psworker

def train():
    with psworker.connect() as client:
        client.init({"w": np.zeros(3, np.float32)}, psworker.SGD(lr=1.0))
        for _ in range(2):
            client.push({"w": np.ones(3, np.float32)})
        w = client.pull()["w"]
    result = {
        "argv": sys.argv, "w": w.tolist(), "mode": client.mode,
        "staleness": client.staleness, "worker_id": os.environ["PS_WORKER_ID"],
        "tf_config": json.loads(os.environ["TF_CONFIG"]),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
    return int(sys.argv[2])

if __name__ == "__main__":
    sys.exit(train())
"""


def cluster(address: str) -> str:
    return json.dumps(
        {
            "cluster": {"ps": [address], "worker": ["127.0.0.1:1"]},
            "task": {"type": "worker", "index": 0},
        }
    )


@pytest.mark.timeout(60)
def test_run_module_function_with_cluster_flag(procs: Processes, tmp_path: Path) -> None:
    daemon = procs.psserver()
    (tmp_path / "jobmod.py").write_text(textwrap.dedent(JOB))
    spec_file = tmp_path / "tf_config.json"
    spec_file.write_text(cluster(daemon.address))
    result = tmp_path / "result.json"
    args = [*PSWORKER, "run", "--cluster", str(spec_file), "--mode", "async", "jobmod:train"]
    # cwd holds jobmod.py: module targets import from the current folder, like `python -m`.
    code, out = procs.run([*args, str(result), "0"], timeout=45, cwd=tmp_path)
    assert code == 0, out
    got = json.loads(result.read_text())
    assert got["w"] == [-2.0, -2.0, -2.0]  # two async pushes of ones at lr 1
    assert got["mode"] == "async"
    assert got["argv"] == ["jobmod:train", str(result), "0"]
    assert got["worker_id"] == "0"
    # The file's JSON, not its path, is what the entry point finds in TF_CONFIG.
    assert got["tf_config"]["cluster"]["ps"] == [daemon.address]


@pytest.mark.timeout(60)
def test_run_script_with_env_twins_and_exit_code(procs: Processes, tmp_path: Path) -> None:
    daemon = procs.psserver()
    script = tmp_path / "job_script.py"
    script.write_text(textwrap.dedent(JOB))
    result = tmp_path / "result.json"
    env = child_env(PS_CLUSTER=cluster(daemon.address), PS_MODE="ssp", PS_STALENESS="2")
    code, out = procs.run([*PSWORKER, "run", str(script), str(result), "7"], timeout=45, env=env)
    assert code == 7, out  # the script's sys.exit code is psworker's
    got = json.loads(result.read_text())
    assert (got["mode"], got["staleness"]) == ("ssp", 2)
    assert got["argv"] == [str(script), str(result), "7"]
    assert got["w"] == [-2.0, -2.0, -2.0]


@pytest.mark.timeout(30)
def test_run_without_cluster_is_a_usage_error(procs: Processes, tmp_path: Path) -> None:
    (tmp_path / "jobmod.py").write_text(textwrap.dedent(JOB))
    code, out = procs.run([*PSWORKER, "run", "jobmod:train"], timeout=20, cwd=tmp_path)
    assert code == 2, out
    assert "no cluster" in out


@pytest.mark.timeout(30)
def test_a_missing_script_is_reported_before_the_missing_cluster(
    procs: Processes, tmp_path: Path
) -> None:
    code, out = procs.run([*PSWORKER, "run", "nope.py"], timeout=20, cwd=tmp_path)
    assert code == 2, out
    assert "no such script: 'nope.py'" in out, out
    assert "no cluster" not in out, out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", ["missing_job.py", "missing_module:train", "jobmod:nope"])
def test_a_missing_target_is_a_usage_error_not_a_traceback(
    procs: Processes, tmp_path: Path, target: str
) -> None:
    (tmp_path / "jobmod.py").write_text(textwrap.dedent(JOB))
    args = [*PSWORKER, "run", "--mode", "local", target]
    code, out = procs.run(args, timeout=20, cwd=tmp_path)
    assert code == 2, out
    assert "Traceback" not in out, out
    expected = {
        "missing_job.py": "no such script: 'missing_job.py'",
        "missing_module:train": "no module named 'missing_module'",
        "jobmod:nope": "jobmod has no attribute 'nope'",
    }[target]
    assert expected in out, out


@pytest.mark.timeout(30)
def test_run_in_mode_local_needs_no_cluster(procs: Processes, tmp_path: Path) -> None:
    (tmp_path / "jobmod.py").write_text(textwrap.dedent(JOB))
    result = tmp_path / "result.json"
    args = [*PSWORKER, "run", "--mode", "local", "jobmod:train", str(result), "0"]
    code, out = procs.run(args, timeout=20, cwd=tmp_path, env=child_env(TF_CONFIG="{}"))
    assert code == 0, out
    got = json.loads(result.read_text())
    assert got["mode"] == "local" and got["w"] == [-2.0, -2.0, -2.0]
