"""Scripts launched by torchrun (and MPI-style launchers) in every mode: rank and world size from
the launcher's variables, the ring by rendezvous at ``$MASTER_ADDR:$MASTER_PORT``, no
TF_CONFIG; each run ends with the model ``psctl local`` trains from the same seed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from e2e_support import REPO, Lines, Processes, child_env, free_port

PSCTL = [sys.executable, "-m", "psctl.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ENV_WORKER = str(REPO / "tests" / "e2e" / "env_worker.py")
DIGITS = str(REPO / "examples" / "train_digits.py")
STEPS = ["--steps", "6"]


def weights(folder: Path, workers: int = 2) -> list[dict[str, np.ndarray]]:
    """Each worker's final weights, as env_worker.py wrote them."""
    out = []
    for w in range(workers):
        with np.load(folder / f"worker{w}.npz") as data:
            out.append({k: data[k] for k in data.files})
    return out


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def psctl_local(procs: Processes, tmp_path: Path, mode: str, worker: list[str]) -> str:
    args = [*PSCTL, "local", "--mode", mode, "--workers", "2", "--servers", "2"]
    code, out = procs.run([*args, "--timeout", "100", "--", *worker], timeout=110)
    assert code == 0, out
    return out


@pytest.mark.timeout(150)
def test_torchrun_allreduce_needs_no_ps_variable(procs: Processes, tmp_path: Path) -> None:
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "psctl").mkdir()
    env = child_env()  # no PS_* at all, no TF_CONFIG: torchrun's RANK, WORLD_SIZE, MASTER_*
    worker = [ENV_WORKER, *STEPS, "--out", str(tmp_path / "torchrun")]
    code, out = procs.run([*TORCHRUN, *worker], timeout=120, env=env)
    assert code == 0, out
    assert out.count('"mode": "allreduce"') == 2, out  # no shards, two ranks: data-parallel
    psctl_local(
        procs, tmp_path, "allreduce", [sys.executable, *worker[:-1], str(tmp_path / "psctl")]
    )
    ranks, reference = weights(tmp_path / "torchrun"), weights(tmp_path / "psctl")
    assert_same(ranks[0], ranks[1])
    assert_same(ranks[0], reference[0])


@pytest.mark.timeout(150)
def test_torchrun_sync_needs_only_the_shards_addresses(procs: Processes, tmp_path: Path) -> None:
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "psctl").mkdir()
    shards = [procs.psserver("--port", "0").address for _ in range(2)]
    env = child_env(PS_SHARDS=",".join(shards))
    worker = [ENV_WORKER, *STEPS, "--out", str(tmp_path / "torchrun")]
    code, out = procs.run([*TORCHRUN, *worker], timeout=120, env=env)
    assert code == 0, out
    assert out.count('"mode": "sync"') == 2, out
    psctl_local(procs, tmp_path, "sync", [sys.executable, *worker[:-1], str(tmp_path / "psctl")])
    ranks, reference = weights(tmp_path / "torchrun"), weights(tmp_path / "psctl")
    assert_same(ranks[0], ranks[1])
    assert_same(ranks[0], reference[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("rank", "size"),
    [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")],
)
def test_mpi_ranks_find_their_ring_through_rank_0s_store(
    procs: Processes, tmp_path: Path, rank: str, size: str
) -> None:
    # As mpirun starts them: no torchrun agent, so rank 0 hosts the store at MASTER_ADDR:PORT.
    port = str(free_port())
    workers = [
        Lines(
            procs.start(
                [sys.executable, ENV_WORKER, *STEPS, "--out", str(tmp_path)],
                env=child_env(
                    **{rank: str(r), size: "2"}, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
                ),
            )
        )
        for r in (1, 0)  # rank 1 first: it must wait for rank 0's store
    ]
    for w in workers:
        w.wait_for(lambda w=w: w.proc.poll() is not None, 100, "the worker's exit")
        assert w.proc.returncode == 0, w.text()
        assert '"mode": "allreduce"' in w.text()
    ranks = weights(tmp_path)
    assert_same(ranks[0], ranks[1])


EPOCH = re.compile(
    r"^\[(?:worker|default)(\d)\]:? ?(epoch \d: loss \S+, held-out accuracy \S+)$", re.M
)


def digits_lines(out: str) -> dict[int, list[str]]:
    """Each worker's 'epoch N: loss, accuracy' lines (psctl's [workerN] or torchrun's
    [defaultN]: prefixes)."""
    found: dict[int, list[str]] = {}
    for m in EPOCH.finditer(out):
        found.setdefault(int(m.group(1)), []).append(m.group(2))
    return found


# Slow (1.5-2 min a mode on 2 busy cores: the digits CNN trained twice, under torchrun and psctl
# local). The fast tests above pin the same launch paths with a numpy worker.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "allreduce"])
def test_torchrun_trains_the_digits_example_as_psctl_local(
    procs: Processes, tmp_path: Path, mode: str
) -> None:
    # No PS_* variable but the shards' addresses (none at all for allreduce); the mode is the
    # script's own --mode, as a user passes any option of their script through torchrun.
    extra: dict[str, str] = {}
    script = [DIGITS] if mode in ("sync", "allreduce") else [DIGITS, "--mode", mode]
    if mode != "allreduce":
        shards = [procs.psserver("--port", "0").address for _ in range(2)]
        extra["PS_SHARDS"] = ",".join(shards)
    code, out = procs.run([*TORCHRUN, "--tee", "3", *script], timeout=250, env=child_env(**extra))
    assert code == 0, out
    torchrun = digits_lines(out)
    local = digits_lines(psctl_local(procs, tmp_path, mode, [sys.executable, DIGITS]))
    assert sorted(torchrun) == sorted(local) == [0, 1], out
    if mode in ("sync", "allreduce"):
        # Deterministic modes: every epoch's loss and accuracy, on every worker, as psctl's.
        assert torchrun == local
    else:
        # async and ssp apply pushes as they arrive, so no two runs are bit-identical; the
        # same training reaches the same accuracy.
        for w in (0, 1):
            mine, theirs = (float(x[-1].rsplit(" ", 1)[1]) for x in (torchrun[w], local[w]))
            assert mine >= 0.9 and abs(mine - theirs) <= 0.03, (torchrun, local)
