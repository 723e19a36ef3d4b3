"""Worker identity and shard addresses from the launchers PyTorch users have: the documented
precedence, and conflicting launchers refused with both named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import psworker
from psworker.elastic import ElasticPSClient, parse_bounds
from psworker.launchers import resolve_identity, shard_addresses

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r1"}
PYTORCHJOB = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0"}
SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_NODELIST": "node[01-03]"}


def tf_config(index: int | None, workers: int = 2) -> str:
    spec: dict = {"cluster": {"ps": ["ps0:7000"], "worker": [f"w{i}:1" for i in range(workers)]}}
    if index is not None:
        spec["task"] = {"type": "worker", "index": index}
    return json.dumps(spec)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, (1, 2, "torchrun")),
        (PYTORCHJOB, (3, 4, "PyTorchJob")),
        (SLURM, (2, 3, "Slurm")),
        ({"PS_WORKER_ID": "0", "PS_NUM_WORKERS": "5"}, (0, 5, "$PS_WORKER_ID")),
        ({"TF_CONFIG": tf_config(1)}, (1, 2, "TF_CONFIG")),
        ({}, (None, None, "")),
    ],
)
def test_each_launcher_alone_names_the_worker(env, expected):
    identity = resolve_identity(environ=env)
    wid, count, source = expected
    assert (identity.worker_id, identity.num_workers) == (wid, count)
    assert source in identity.id_source


def test_sources_that_agree_are_fine_and_arguments_override_the_environment():
    env = {**TORCHRUN, "PS_WORKER_ID": "1", "PS_NUM_WORKERS": "2", "TF_CONFIG": tf_config(1)}
    identity = resolve_identity(environ=env)
    assert (identity.worker_id, identity.num_workers) == (1, 2)
    assert identity.id_source.startswith("$PS_WORKER_ID")  # the first in precedence order
    assert resolve_identity(7, 9, environ=env).worker_id == 7  # the caller knows best


@pytest.mark.parametrize(
    ("env", "first", "second"),
    [
        ({**TORCHRUN, "PS_WORKER_ID": "0"}, "$PS_WORKER_ID", "torchrun"),
        ({**PYTORCHJOB, "TF_CONFIG": tf_config(0, 4)}, "TF_CONFIG", "PyTorchJob"),
        ({**SLURM, "PS_NUM_WORKERS": "4", "PS_WORKER_ID": "2"}, "$PS_WORKER_ID", "Slurm"),
        ({**SLURM, "TF_CONFIG": tf_config(1, 3)}, "TF_CONFIG", "Slurm"),
    ],
)
def test_conflicting_launchers_are_an_error_naming_both(env, first, second):
    with pytest.raises(psworker.ConfigError, match="conflicting launchers") as info:
        resolve_identity(environ=env)
    message = str(info.value)
    assert first in message and second in message, message


def test_torchrun_inside_a_slurm_task_describes_the_worker():
    # srun starts one torchrun agent per node; Slurm's ids are the agent's, not the worker's.
    env = {**SLURM, **TORCHRUN}
    identity = resolve_identity(environ=env)
    assert (identity.worker_id, identity.num_workers) == (1, 2)


def test_a_task_less_tf_config_takes_the_id_from_the_launcher():
    env = {**TORCHRUN, "TF_CONFIG": tf_config(None)}
    assert resolve_identity(environ=env).worker_id == 1
    env = {"TF_CONFIG": tf_config(None), "JOB_COMPLETION_INDEX": "1"}
    assert resolve_identity(environ=env).worker_id == 1


def test_bad_values_are_named():
    with pytest.raises(psworker.ConfigError, match=r"\$RANK='x'"):
        resolve_identity(environ={"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(psworker.ConfigError, match=r"\$SLURM_NTASKS='0' must be >= 1"):
        resolve_identity(environ={"SLURM_PROCID": "0", "SLURM_NTASKS": "0"})


def test_shard_addresses_from_each_source_and_their_conflicts(tmp_path: Path):
    listing = tmp_path / "shards.txt"
    listing.write_text("# the job's shards\nps0:7000\nps1:7001, ps2:7002\n")
    three = ["ps0:7000", "ps1:7001", "ps2:7002"]
    assert shard_addresses(environ={"PS_SHARDS": "ps0:7000,ps1:7001,ps2:7002"}) == (
        three,
        "$PS_SHARDS",
    )
    assert shard_addresses(environ={"PS_SHARDS_FILE": str(listing)})[0] == three
    assert shard_addresses(environ={"TF_CONFIG": tf_config(0)})[0] == ["ps0:7000"]
    assert shard_addresses(["a:1"], {"PS_SHARDS": "b:2"}) == (["a:1"], "addresses=")
    assert shard_addresses(environ={}) is None
    with pytest.raises(psworker.ConfigError, match=r"\$PS_SHARDS gives .* TF_CONFIG's"):
        shard_addresses(environ={"PS_SHARDS": "b:2", "TF_CONFIG": tf_config(0)})
    with pytest.raises(psworker.ConfigError, match="'ps0' is not host:port"):
        shard_addresses(environ={"PS_SHARDS": "ps0"})
    with pytest.raises(psworker.ConfigError, match="cannot be read"):
        shard_addresses(environ={"PS_SHARDS_FILE": str(tmp_path / "missing")})


def test_connect_reads_torchrun_and_slurm_and_the_elastic_bounds(monkeypatch):
    for name, value in {**TORCHRUN, "PS_SHARDS": "127.0.0.1:7001", "PS_ELASTIC": "2:4"}.items():
        monkeypatch.setenv(name, value)
    with psworker.connect() as client:  # nothing is called before init
        assert isinstance(client, ElasticPSClient)
        assert (client.worker_id, client.min_workers, client.max_workers) == (1, 2, 4)
    for name in (*TORCHRUN, "PS_ELASTIC"):
        monkeypatch.delenv(name)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    with psworker.connect() as client:
        assert (client.worker_id, client.num_workers) == (2, 3)
    monkeypatch.delenv("PS_SHARDS")
    with pytest.raises(psworker.ConfigError, match="one of 3 workers"):
        psworker.connect()  # several workers but no shards: not three lone local runs


def test_elastic_bounds_are_checked():
    assert parse_bounds("2:4") == (2, 4) and parse_bounds("3") == (3, 3)
    for bad in ("4:2", "0:3", "a:b", ""):
        with pytest.raises(psworker.ConfigError):
            parse_bounds(bad)
    with pytest.raises(psworker.ConfigError, match=r"worker_id 4 must be in \[0, max_workers=4\)"):
        psworker.connect(["127.0.0.1:7001"], worker_id=4, elastic="1:4")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, (1, 3, "Open MPI")),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, (2, 4, "MPI")),
        # srun --mpi=pmi2 sets both Slurm's and PMI's: they agree.
        ({**SLURM, "PMI_RANK": "2", "PMI_SIZE": "3"}, (2, 3, "Slurm")),
    ],
)
def test_mpi_launchers_name_the_worker(env, expected):
    identity = resolve_identity(environ=env)
    assert (identity.worker_id, identity.num_workers) == expected[:2]
    assert expected[2] in identity.id_source


def test_mpi_disagreeing_with_slurm_is_refused_and_torchrun_inside_mpi_wins():
    with pytest.raises(ValueError, match=r"Slurm\) gives worker id 2, but .*PMI_RANK"):
        resolve_identity(environ={**SLURM, "PMI_RANK": "0", "PMI_SIZE": "3"})
    # mpirun -np 2 torchrun ...: MPI's ranks are the agents', torchrun's the workers'.
    env = {**TORCHRUN, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert (resolve_identity(environ=env).worker_id, resolve_identity(environ=env).num_workers) == (
        1,
        2,
    )
