"""The launch files in deploy/: the Slurm batch script runs shards and workers under a stand-in
srun (each task with the SLURM_PROCID/SLURM_NTASKS real srun sets), and the Kubeflow PyTorchJob
gives each pod the worker id and shards psworker reads from the operator's variables."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

import pytest
import yaml
from e2e_support import REPO, Processes, child_env, free_port

from pswire.cluster import ClusterSpec
from psworker import main as psworker_main

SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
PYTORCHJOB = REPO / "deploy" / "k8s" / "pytorchjob" / "pytorchjob.yaml"

# Real srun starts --ntasks copies of the command, task i with SLURM_PROCID=i and SLURM_NTASKS;
# this one does the same on this machine, and forwards SIGTERM to them as srun does.
FAKE_SRUN = """#!/usr/bin/env python3
import os, signal, subprocess, sys
args, tasks = sys.argv[1:], 1
while args and args[0].startswith("-"):
    arg = args.pop(0)
    if arg.startswith("--ntasks="):
        tasks = int(arg.split("=", 1)[1])
env = dict(os.environ, SLURM_NTASKS=str(tasks))
procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i))) for i in range(tasks)]
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs])
codes = [p.wait() for p in procs]
sys.exit(max(codes, key=abs))
"""
FAKE_SCONTROL = """#!/bin/sh
echo localhost
"""


@pytest.mark.timeout(300)
def test_the_sbatch_script_trains_the_example_with_slurm_task_ids(
    procs: Processes, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    python_dir = Path(sys.executable).parent
    env = child_env(
        PATH=f"{bin_dir}:{python_dir}:/usr/bin:/bin",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_ID="18",
        PS_BASE_PORT=str(_free_base_port()),
    )
    example = REPO / "examples" / "train_elastic.py"
    code, out = procs.run(
        ["bash", str(SBATCH), str(example), "--epochs", "2"], timeout=280, env=env, cwd=REPO
    )
    assert code == 0, out
    # The tasks share one pipe: a line of one may run into a line of the other.
    finals = re.findall(
        r"epoch 1: loss \S+, held-out accuracy (\d\.\d+), 750 samples on this worker, split "
        r"among workers \[0, 1\]",
        out,
    )
    assert len(finals) == 2 and len(set(finals)) == 1, out  # both tasks, one model


def _free_base_port() -> int:
    """A port P with P and P + 1 free right now (the two shards' ports)."""
    for _ in range(50):
        base = free_port()  # below the ephemeral range, as tests/ports.py says why
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise AssertionError("no two adjacent free ports")


def test_the_pytorchjob_gives_each_pod_its_worker_id_and_the_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    world = sum(s["replicas"] for s in specs.values())
    shards = yaml.safe_load_all((REPO / "deploy" / "k8s" / "ps-statefulset.yaml").read_text())
    replicas = next(d for d in shards if d and d["kind"] == "StatefulSet")["spec"]["replicas"]
    for role, first_rank in (("Master", 0), ("Worker", 1)):
        (container,) = specs[role]["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the operator's container name
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["PS_SHARDS"].split(",") == [f"ps-{i}.ps:7000" for i in range(replicas)]
        args = psworker_main.build_parser().parse_args(container["command"][3:])
        assert args.elastic == "2:4" and args.target == "psctl.demo:main"
        # What the operator sets in the pod, and what psworker run makes of it.
        for key in ("PS_WORKER_ID", "PS_NUM_WORKERS", "TF_CONFIG", "PS_SHARDS", "PS_ELASTIC"):
            monkeypatch.delenv(key, raising=False)
        for key, value in {
            **env,
            "RANK": str(first_rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "psgrpc-workers-master-0",
        }.items():
            monkeypatch.setenv(key, value)
        spec = psworker_main.export_job(None, args.mode, None, args.shards, args.elastic)
        assert spec == ClusterSpec(tuple(env["PS_SHARDS"].split(",")), (), "worker", first_rank)
        assert (
            psworker_main.os.environ["PS_ELASTIC"],
            psworker_main.os.environ["PS_WORKER_ID"],
        ) == (
            "2:4",
            str(first_rank),
        )
