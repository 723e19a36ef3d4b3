"""``connect``: the client a training script gets for its mode and cluster."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from pscore.optim import Optimizer
from pswire import envnames
from pswire.cli import env_default
from pswire.cluster import ClusterSpec
from pswire.errors import ConfigError
from pswire.security import ClientSecurity
from psworker.api import Client
from psworker.client import PSClient
from psworker.diloco import PAPER_OUTER, DiLoCoClient, DiLoCoSettings
from psworker.elastic import ElasticPSClient, parse_bounds
from psworker.launchers import Identity, resolve_identity, shard_addresses
from psworker.local import LocalClient
from psworker.ring.algorithm import DEFAULT_TIMEOUT_S as RING_TIMEOUT_S
from psworker.ring.client import AllReduceClient
from psworker.ring.rendezvous import RendezvousSettings, rendezvous_ring
from psworker.settings import ClientSettings, resolve_mode, setting_from_env

log = logging.getLogger(__name__)
# elastic=True without bounds (and no $PS_ELASTIC): from 1 to this many workers.
DEFAULT_MAX_WORKERS = 64


def _connect_ring(
    peers: Sequence[str] | None,
    identity: Identity,
    environ: dict[str, str],
    options: dict,
    security: ClientSecurity,
) -> AllReduceClient:
    """The all-reduce client: peers are ``addresses``, else the cluster's workers, else found
    by rendezvous at ``$MASTER_ADDR:$MASTER_PORT`` (``psworker.ring.rendezvous``).

    Raises:
        ConfigError: nothing says where the ring is, or options that do not apply.
    """
    allowed = {"timeout", "bucket_bytes", "compression", "server"}
    unknown = set(options) - allowed
    if unknown:
        raise ConfigError(f"options {sorted(unknown)} do not apply to mode 'allreduce'")
    worker_id = identity.worker_id
    store = None
    if peers is None:
        spec = ClusterSpec.load(environ.get("TF_CONFIG") or None, role="worker")
        if spec is not None and spec.workers:
            peers = spec.workers
            worker_id = spec.task_index if worker_id is None else worker_id
    if peers is None:
        count = identity.num_workers
        timeout = float(options.get("timeout", RING_TIMEOUT_S))
        settings = RendezvousSettings.from_env(worker_id or 0, count or 1, timeout, environ)
        if settings is None and count != 1:
            said = f" with {count} workers ({identity.count_source})" if count else ""
            raise ConfigError(
                f"mode 'allreduce'{said} needs the workers' ring addresses: set $MASTER_ADDR "
                "and $MASTER_PORT (torchrun does) for a rendezvous, or pass addresses=..., "
                "cluster=..., or $TF_CONFIG with cluster.worker"
            )
        if (count or 1) > 1 and worker_id is None:
            raise ConfigError(
                f"mode 'allreduce' with {count} workers ({identity.count_source}) needs this "
                "worker's rank: $RANK, $PS_WORKER_ID or worker_id="
            )
        if settings is None:
            peers = ["127.0.0.1:0"]  # a launcher said one worker: a ring of one
        else:
            server, peers, store = rendezvous_ring(settings, security)
            options = {**options, "server": server}
    return AllReduceClient(
        0 if worker_id is None else worker_id,
        peers,
        security=security,
        rendezvous=store,
        **options,
    )


def connect(
    addresses: Sequence[str] | None = None,
    *,
    worker_id: int | None = None,
    num_workers: int | None = None,
    mode: str | None = None,
    staleness: int | None = None,
    cluster: str | None = None,
    elastic: bool | str | tuple[int, int] | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token: str | None = None,
    local_steps: int | None = None,
    outer: Optimizer | None = None,
    outer_sync: bool | None = None,
    dynamic_local_steps: bool | None = None,
    fragments: int | None = None,
    overlap_steps: int | None = None,
    mix: float | None = None,
    worker_state_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Client:
    """Connects a worker to the job's shards, or returns an in-process or ring client.

    The shards are ``addresses``, else ``$PS_SHARDS`` (``host:port,...``), else the file
    ``$PS_SHARDS_FILE`` (one address a line), else ``cluster.ps`` of ``cluster`` (TF_CONFIG
    JSON or a file path) or of ``$TF_CONFIG``. This worker's id and the worker count are
    ``worker_id``/``num_workers``, else read from the launcher: ``$PS_WORKER_ID`` and
    ``$PS_NUM_WORKERS``, TF_CONFIG's ``task.index`` and ``cluster.worker``, torchrun's or a
    Kubeflow PyTorchJob's ``$RANK`` and ``$WORLD_SIZE``, Slurm's ``$SLURM_PROCID`` and
    ``$SLURM_NTASKS``, in that order; two launchers that disagree are an error naming both
    (``psworker.launchers`` says more). ``mode`` and ``staleness`` default to ``$PS_MODE`` /
    ``$PS_STALENESS``, else ``sync`` / 0. ``mode="local"``, or no mode and no shards at all
    (and no launcher saying there are several workers), gives a ``LocalClient``: the same
    script then trains in one process. ``mode="allreduce"`` gives an ``AllReduceClient``: no
    shards; ``addresses`` (or the cluster's ``worker`` list) are the workers' own ring
    addresses, this one at ``worker_id``; without them the ranks find each other through
    torch's TCPStore at ``$MASTER_ADDR:$MASTER_PORT`` (as torchrun sets them). No mode, no
    shards, several workers and ``$MASTER_ADDR`` set (torchrun, PyTorchJob) is ``allreduce``
    too: the launcher's job, data-parallel.

    ``elastic`` (``$PS_ELASTIC``): ``"MIN:MAX"`` or ``(MIN, MAX)`` makes the job elastic
    (``ElasticPSClient``): workers join and leave while it runs, and it trains while it has at
    least MIN members; worker ids are in ``[0, MAX)``. ``True`` is ``1:64``.

    ``tls_ca`` (verify the shards; TLS on), ``tls_cert``/``tls_key`` (this worker's certificate,
    for shards that demand mutual TLS) and ``token`` default to ``$PS_TLS_CA``,
    ``$PS_TLS_CERT``, ``$PS_TLS_KEY`` and ``$PS_TOKEN`` (or the file ``$PS_TOKEN_FILE``). In
    ``allreduce`` they secure the ring: each worker's ring server serves with its certificate
    (demanding its neighbour's, signed by the CA) and the token, and calls its neighbour with
    them.

    ``mode="diloco"`` trains with local steps (DiLoCo, ``psworker/diloco.py``): the script's
    optimizer runs in the worker for ``local_steps`` steps (``$PS_LOCAL_STEPS``, default 1)
    between outer steps, where the shards apply ``outer`` (default ``SGD(lr=0.7,
    momentum=0.9, nesterov=True)``) to the workers' pseudo-gradients: averaged over the live
    workers when ``outer_sync`` (default), else each on arrival (delayed Nesterov;
    ``dynamic_local_steps`` then scales each worker's local steps by its pace, so a slow worker
    takes fewer). Streaming DiLoCo: ``fragments`` (dividing ``local_steps``) staggers the
    outer steps of that many parts of the model by ``local_steps / fragments`` inner steps;
    ``overlap_steps`` lets a part's exchange run under that many inner steps, its new weights
    then merged as ``mix * local + (1 - mix) * job's`` (``DiLoCoSettings``).
    ``worker_state_dir`` (``$PS_WORKER_STATE_DIR``): where each worker keeps its local weights,
    inner optimizer state and random generators after every outer step, so that a worker
    killed and restarted resumes where it was (``psworker/diloco_resume.py``). It returns a
    ``DiLoCoClient``.

    In a parameter-server mode every other keyword (``timeout``, ``retry_s``,
    ``chunk_bytes``, ``quorum``, ``heartbeat_s``, ``compression``, ...) is a field of
    ``ClientSettings``, which ``ClientSettings.from_env`` builds from the arguments, then the
    ``PS_*`` variables, then the defaults: ``job_id`` (``$PS_JOB_ID``) fixes the job's
    identity; ``replay_bytes`` (``$PS_REPLAY_BYTES``) bounds the pushes kept for replay after
    a shard restart; ``stall_warning_s`` (``$PS_STALL_WARNING``, default 10) is how often a
    step that waits for other workers logs a warning naming them (0: never).

    Raises:
        ConfigError: an unknown mode or setting, a parameter-server mode with no shards, an
            address without a port, unreadable TLS files, launchers that disagree, or
            inconsistent arguments such as several workers but no worker id (a ValueError).
    """
    envnames.warn_unknown(who="connect()")
    mode = resolve_mode(mode)
    diloco = _diloco_settings(
        mode,
        {
            "local_steps": local_steps,
            "outer": outer,
            "outer_sync": outer_sync,
            "dynamic_local_steps": dynamic_local_steps,
            "fragments": fragments,
            "overlap_steps": overlap_steps,
            "mix": mix,
        },
    )
    if worker_state_dir is None:
        worker_state_dir = os.environ.get("PS_WORKER_STATE_DIR") or None
    if worker_state_dir is not None and diloco is None:
        raise ConfigError(f"worker_state_dir applies to mode 'diloco' only; mode is {mode!r}")
    if options.get("compression") is None and setting_from_env("compression") is not None:
        options["compression"] = setting_from_env("compression")  # the ring's too
    if mode == "local":
        return LocalClient()
    environ = dict(os.environ) if cluster is None else {**os.environ, "TF_CONFIG": cluster}
    identity = resolve_identity(worker_id, num_workers, environ)
    if mode == "allreduce":
        security = ClientSecurity.from_env(tls_ca, tls_cert, tls_key, token)
        return _connect_ring(addresses, identity, environ, options, security)
    found = shard_addresses(addresses, environ)
    if found is None:
        if mode is None and (identity.num_workers or 1) == 1:
            return LocalClient()
        if mode is None and environ.get("MASTER_ADDR"):
            # torchrun (or PyTorchJob, Slurm, MPI) with no shards: data-parallel, as DDP would.
            if identity.worker_id == 0:
                log.warning(
                    "no shards given and %s says %d workers: training in mode 'allreduce' "
                    "(ring found through $MASTER_ADDR:$MASTER_PORT); set $PS_SHARDS for a "
                    "parameter-server job",
                    identity.count_source,
                    identity.num_workers,
                )
            security = ClientSecurity.from_env(tls_ca, tls_cert, tls_key, token)
            return _connect_ring(None, identity, environ, options, security)
        raise ConfigError(
            f"mode {mode or 'sync'!r} needs the shards' addresses: addresses=..., $PS_SHARDS, "
            "$PS_SHARDS_FILE, cluster=..., or $TF_CONFIG with cluster.ps"
            + (
                f" ({identity.count_source} says this is one of {identity.num_workers} workers)"
                if (identity.num_workers or 1) > 1
                else " (or use mode='local')"
            )
        )
    shards, where = found
    if not shards:
        raise ConfigError(f"{where} lists no parameter servers")
    secure = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key, "token": token}
    given = dict(
        mode=diloco.shard_mode if diloco else mode, staleness=staleness, **secure, **options
    )
    bounds = _elastic_bounds(elastic)
    if bounds is not None:
        if identity.worker_id is None and bounds[1] > 1:
            raise ConfigError(
                f"an elastic job of up to {bounds[1]} workers needs each worker's id: pass "
                "worker_id=, or set $PS_WORKER_ID (or launch with torchrun, srun, TF_CONFIG)"
            )
        low, high = bounds
        settings = ClientSettings.from_env(
            shards, identity.worker_id or 0, high, min_workers=low, max_workers=high, **given
        )
        elastic_client = ElasticPSClient(settings)
        return DiLoCoClient(elastic_client, diloco, worker_state_dir) if diloco else elastic_client
    count = identity.num_workers
    if identity.worker_id is None and (count or 1) > 1:
        raise ConfigError(
            f"a job of {count} workers ({identity.count_source}) needs each worker's id: pass "
            "worker_id=, or set $PS_WORKER_ID or TF_CONFIG's task.index (two processes as one "
            "worker would have the second's pushes dropped as retries)"
        )
    settings = ClientSettings.from_env(shards, identity.worker_id or 0, count or 1, **given)
    _log_identity(identity)
    client = PSClient(settings)
    return DiLoCoClient(client, diloco, worker_state_dir) if diloco else client


def _diloco_settings(mode: str | None, given: dict[str, Any]) -> DiLoCoSettings | None:
    """The local-step settings of ``mode="diloco"`` from ``given`` (``DiLoCoSettings``'
    fields, None where not given; ``local_steps`` else ``$PS_LOCAL_STEPS``); None in other
    modes.

    Raises:
        ConfigError: bad settings, or settings given for another mode.
    """
    named = {k: v for k, v in given.items() if v is not None}
    if mode != "diloco":
        if named:
            raise ConfigError(f"{', '.join(named)} apply to mode 'diloco' only; mode is {mode!r}")
        return None
    if "local_steps" not in named:
        named["local_steps"] = env_default("PS_LOCAL_STEPS", 1, int)
    named.setdefault("outer", PAPER_OUTER)
    return DiLoCoSettings(**named)


def _elastic_bounds(elastic: bool | str | tuple[int, int] | None) -> tuple[int, int] | None:
    """(min, max) of an elastic job from ``elastic`` or ``$PS_ELASTIC``; None: fixed size.

    Raises:
        ConfigError: malformed bounds.
    """
    if elastic is None or elastic is True:
        text = os.environ.get("PS_ELASTIC", "").strip()
        if text:
            return parse_bounds(text, "$PS_ELASTIC")
        return (1, DEFAULT_MAX_WORKERS) if elastic else None
    if elastic is False:
        return None
    if isinstance(elastic, str):
        return parse_bounds(elastic)
    return parse_bounds(f"{elastic[0]}:{elastic[1]}")


def _log_identity(identity: Identity) -> None:
    if identity.restarts:
        log.warning(
            "torchrun restarted its workers %d time(s): worker %s resumes at the shards' step",
            identity.restarts,
            identity.worker_id,
        )
