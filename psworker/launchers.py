"""Who this worker is, how many there are, and where the shards are, from whatever launched it.

Sources of the worker's id and count, first that says wins:

1. ``connect()``'s arguments (``worker_id=``, ``num_workers=``);
2. ``$PS_WORKER_ID`` / ``$PS_NUM_WORKERS`` (``psctl local`` and ``psworker run`` set them);
3. ``TF_CONFIG``: ``task.index`` and the length of ``cluster.worker``;
4. torchrun: ``$RANK`` / ``$WORLD_SIZE`` (with ``$TORCHELASTIC_RUN_ID``), or Kubeflow's
   PyTorchJob, whose operator sets the same two (with ``$MASTER_ADDR``, without torchrun's);
5. Slurm: ``$SLURM_PROCID`` / ``$SLURM_NTASKS`` (one task per worker, as ``srun`` starts them);
6. MPI: Open MPI's ``$OMPI_COMM_WORLD_RANK`` / ``$OMPI_COMM_WORLD_SIZE``, or MPICH's and Intel
   MPI's ``$PMI_RANK`` / ``$PMI_SIZE`` (one rank per worker, as ``mpirun -np N`` starts them);
7. a ``TF_CONFIG`` without a task: ``$PS_TASK_INDEX``, ``$JOB_COMPLETION_INDEX`` or a
   StatefulSet hostname's ordinal (``pswire.cluster.task_index_from_env``).

Arguments override the environment. Two environment sources that both say and disagree are an
error naming both: a worker must never train under an id another process also holds. One
exception: torchrun started inside a Slurm task or an MPI rank (``srun torchrun ...``) describes
the worker; Slurm's and MPI's variables then describe torchrun's agent, and are not read.

Mode ``allreduce`` needs no shards but every worker's ring address: without them in
``addresses``/TF_CONFIG, the ranks find each other through torch's ``TCPStore`` at
``$MASTER_ADDR:$MASTER_PORT`` (``psworker.ring.rendezvous``), which torchrun, PyTorchJob and
the usual Slurm/MPI scripts set.

Shard addresses, first that says wins: ``connect()``'s ``addresses``, ``$PS_SHARDS``
(``host:port,host:port``), ``$PS_SHARDS_FILE`` (a file of addresses, one per line or
comma-separated, ``#`` comments), ``TF_CONFIG``'s ``cluster.ps``; two environment sources that
disagree are an error naming both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pswire.cluster import ClusterSpec, task_index_from_env
from pswire.errors import ConfigError

# Launcher variables psctl local strips from its children: the cluster it builds is theirs.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "PS_SHARDS",
    "PS_SHARDS_FILE",
)


@dataclass(frozen=True)
class Said:
    """What one source says: ``worker_id`` and ``num_workers`` (None: it does not say)."""

    source: str
    worker_id: int | None
    num_workers: int | None


@dataclass(frozen=True)
class Identity:
    """This worker's id and the job's worker count, with the source of each (for messages)."""

    worker_id: int | None
    num_workers: int | None
    id_source: str = ""
    count_source: str = ""
    restarts: int = 0  # torchrun: times the agent restarted its workers


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    """``$name`` as an integer >= ``minimum``; None when unset or empty.

    Raises:
        ConfigError: set, but not such an integer.
    """
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"${name}={text!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"${name}={text!r} must be >= {minimum}")
    return value


def _tf_config(env: Mapping[str, str]) -> tuple[ClusterSpec | None, bool]:
    """TF_CONFIG's spec (None: unset) and whether it names this process's task.

    Raises:
        ConfigError: unreadable or malformed.
    """
    text = env.get("TF_CONFIG", "").strip()
    if not text:
        return None, False
    if not text.startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"$TF_CONFIG {text!r} is neither JSON nor a readable file")
        text = path.read_text()
    try:
        has_task = bool(json.loads(text).get("task"))
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"$TF_CONFIG is not a JSON object: {exc}") from None
    # Without a task the index comes from the other sources (or the environment, last).
    return ClusterSpec.parse(text, None), has_task


def environment_sources(environ: Mapping[str, str] | None = None) -> list[Said]:
    """Every source in the environment that says something, in precedence order.

    Raises:
        ConfigError: a malformed variable.
    """
    env = os.environ if environ is None else environ
    found = [
        Said(
            "$PS_WORKER_ID/$PS_NUM_WORKERS",
            _int(env, "PS_WORKER_ID", 0),
            _int(env, "PS_NUM_WORKERS", 1),
        )
    ]
    spec, has_task = _tf_config(env)
    if spec is not None:
        found.append(
            Said(
                "TF_CONFIG",
                spec.task_index if has_task and spec.task_type == "worker" else None,
                len(spec.workers) or None,
            )
        )
    torchrun = bool(env.get("TORCHELASTIC_RUN_ID"))
    rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
    if torchrun or env.get("LOCAL_RANK"):
        found.append(Said("$RANK/$WORLD_SIZE (torchrun)", rank, world))
    elif rank is not None or world is not None:
        found.append(Said("$RANK/$WORLD_SIZE (PyTorchJob)", rank, world))
    if not torchrun:
        tasks = _int(env, "SLURM_NTASKS", 1) or _int(env, "SLURM_NPROCS", 1)
        found.append(
            Said("$SLURM_PROCID/$SLURM_NTASKS (Slurm)", _int(env, "SLURM_PROCID", 0), tasks)
        )
        found.append(
            Said(
                "$OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE (Open MPI)",
                _int(env, "OMPI_COMM_WORLD_RANK", 0),
                _int(env, "OMPI_COMM_WORLD_SIZE", 1),
            )
        )
        found.append(
            Said("$PMI_RANK/$PMI_SIZE (MPI)", _int(env, "PMI_RANK", 0), _int(env, "PMI_SIZE", 1))
        )
    return [s for s in found if s.worker_id is not None or s.num_workers is not None]


def resolve_identity(
    worker_id: int | None = None,
    num_workers: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Identity:
    """This worker's id and count by the precedence in this module's docstring.

    Raises:
        ConfigError: two environment sources disagree (both named), a malformed variable.
    """
    env = os.environ if environ is None else environ
    sources = environment_sources(env)
    for field, label in (("worker_id", "worker id"), ("num_workers", "worker count")):
        said = [s for s in sources if getattr(s, field) is not None]
        for other in said[1:]:
            if getattr(other, field) != getattr(said[0], field):
                first = said[0]
                raise ConfigError(
                    f"conflicting launchers: {first.source} gives {label} "
                    f"{getattr(first, field)}, but {other.source} gives {getattr(other, field)}. "
                    "Unset one of them (or make them agree); a worker must not train under an "
                    "id another process may hold"
                )
    ids = [(s.worker_id, s.source) for s in sources if s.worker_id is not None]
    counts = [(s.num_workers, s.source) for s in sources if s.num_workers is not None]
    if worker_id is not None:
        ids.insert(0, (worker_id, "worker_id="))
    if num_workers is not None:
        counts.insert(0, (num_workers, "num_workers="))
    if not ids and "TF_CONFIG" in {s.source for s in sources}:
        index = task_index_from_env(env)
        if index is not None:
            ids.append((index, "the task index ($PS_TASK_INDEX, $JOB_COMPLETION_INDEX, host)"))
    wid, id_source = ids[0] if ids else (None, "")
    count, count_source = counts[0] if counts else (None, "")
    restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", 0) or 0
    return Identity(wid, count, id_source, count_source, restarts)


def _addresses(text: str, where: str) -> list[str]:
    """Addresses from a comma- or line-separated list (``#`` starts a comment).

    Raises:
        ConfigError: an address without a port.
    """
    out = []
    for line in text.splitlines():
        for item in line.split("#", 1)[0].split(","):
            address = item.strip()
            if not address:
                continue
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"{where}: {address!r} is not host:port")
            out.append(address)
    return out


def shard_addresses(
    addresses: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[list[str], str] | None:
    """The shards' addresses and where they came from; None when nothing says.

    Raises:
        ConfigError: two sources disagree (both named), an unreadable file, a bad address.
    """
    if addresses is not None:
        return list(addresses), "addresses="
    env = os.environ if environ is None else environ
    found: list[tuple[list[str], str]] = []
    if env.get("PS_SHARDS", "").strip():
        found.append((_addresses(env["PS_SHARDS"], "$PS_SHARDS"), "$PS_SHARDS"))
    path = env.get("PS_SHARDS_FILE", "").strip()
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"$PS_SHARDS_FILE={path!r} cannot be read: {exc}") from None
        found.append((_addresses(text, f"$PS_SHARDS_FILE ({path})"), f"$PS_SHARDS_FILE ({path})"))
    spec, _ = _tf_config(env)
    if spec is not None and spec.ps:
        found.append((list(spec.ps), "TF_CONFIG's cluster.ps"))
    for listed, source in found[1:]:
        if listed != found[0][0]:
            raise ConfigError(
                f"conflicting shard lists: {found[0][1]} gives {found[0][0]}, but {source} "
                f"gives {listed}. Unset one of them (or make them agree)"
            )
    return found[0] if found else None
