"""``connect``: the client a training script gets for its mode and cluster."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pswire.cli import env_default
from pswire.cluster import ClusterSpec
from pswire.errors import ConfigError
from pswire.job import CLIENT_MODES
from pswire.security import ClientSecurity
from psworker.api import Client
from psworker.client import PSClient
from psworker.local import LocalClient
from psworker.ring.client import AllReduceClient


def _connect_ring(
    peers: Sequence[str] | None,
    worker_id: int | None,
    cluster: str | None,
    options: dict,
    security: ClientSecurity,
) -> AllReduceClient:
    """The all-reduce client: peers are the cluster's workers (``addresses`` if given)."""
    if peers is None:
        spec = ClusterSpec.load(cluster, role="worker")
        if spec is None or not spec.workers:
            raise ConfigError(
                "mode 'allreduce' needs the workers' ring addresses: addresses=..., "
                "cluster=..., or $TF_CONFIG with cluster.worker"
            )
        peers = spec.workers
        worker_id = spec.task_index if worker_id is None else worker_id
    allowed = {"timeout", "bucket_bytes", "compression", "server"}
    unknown = set(options) - allowed
    if unknown:
        raise ConfigError(f"options {sorted(unknown)} do not apply to mode 'allreduce'")
    return AllReduceClient(
        0 if worker_id is None else worker_id, peers, security=security, **options
    )


def connect(
    addresses: Sequence[str] | None = None,
    *,
    worker_id: int | None = None,
    num_workers: int | None = None,
    mode: str | None = None,
    staleness: int | None = None,
    cluster: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token: str | None = None,
    **options: Any,
) -> Client:
    """Connects a worker to the job's shards, or returns an in-process or ring client.

    With no ``addresses``, the cluster comes from ``cluster`` (TF_CONFIG JSON or a file path)
    or the ``TF_CONFIG`` environment variable: shards from ``cluster.ps``, this worker's id from
    ``task.index``, the worker count from ``cluster.worker``. ``mode`` and ``staleness`` default
    to ``$PS_MODE`` / ``$PS_STALENESS``, else ``sync`` / 0. ``mode="local"``, or no mode and no
    cluster at all, gives a ``LocalClient``: the same script then trains in one process.
    ``mode="allreduce"`` gives an ``AllReduceClient``: no shards; ``addresses`` (or the
    cluster's ``worker`` list) are the workers' own ring addresses, this one at ``worker_id``.

    ``tls_ca`` (verify the shards; TLS on), ``tls_cert``/``tls_key`` (this worker's certificate,
    for shards that demand mutual TLS) and ``token`` default to ``$PS_TLS_CA``,
    ``$PS_TLS_CERT``, ``$PS_TLS_KEY`` and ``$PS_TOKEN`` (or the file ``$PS_TOKEN_FILE``). In
    ``allreduce`` they secure the ring: each worker's ring server serves with its certificate
    (demanding its neighbour's, signed by the CA) and the token, and calls its neighbour with
    them.

    Without a cluster spec, ``worker_id`` and ``num_workers`` default to ``$PS_WORKER_ID`` and
    ``$PS_NUM_WORKERS`` (else worker 0 of 1); a job of several workers needs each one's id.
    ``job_id`` (``$PS_JOB_ID``) fixes the job's identity; ``replay_bytes``
    (``$PS_REPLAY_BYTES``) bounds the pushes kept for replay after a shard restart.

    Raises:
        ConfigError: an unknown mode, a parameter-server mode with no cluster, an address
            without a port, unreadable TLS files, or inconsistent arguments such as several
            workers but no worker id (a ValueError).
    """
    given = mode
    mode = mode or os.environ.get("PS_MODE") or None
    if mode is not None and mode not in CLIENT_MODES:
        source = "mode" if given else "$PS_MODE"
        raise ConfigError(f"{source}={mode!r} is not a mode; expected one of {list(CLIENT_MODES)}")
    if "compression" not in options and os.environ.get("PS_COMPRESSION"):
        options["compression"] = os.environ["PS_COMPRESSION"]
    if mode == "local":
        return LocalClient()
    if mode == "allreduce":
        security = ClientSecurity.from_env(tls_ca, tls_cert, tls_key, token)
        return _connect_ring(addresses, worker_id, cluster, options, security)
    if addresses is None:
        spec = ClusterSpec.load(cluster, role="worker")
        if spec is None:
            if mode is None:
                return LocalClient()
            raise ConfigError(
                f"mode {mode!r} needs shard addresses, cluster=..., or $TF_CONFIG "
                "(or use mode='local')"
            )
        if not spec.ps:
            raise ConfigError("the cluster spec lists no parameter servers (cluster.ps)")
        addresses = spec.ps
        worker_id = spec.task_index if worker_id is None else worker_id
        num_workers = (len(spec.workers) or 1) if num_workers is None else num_workers
    if staleness is None:
        staleness = env_default("PS_STALENESS", 0, int)
    if worker_id is None:
        worker_id = env_default("PS_WORKER_ID", None, int)
    if num_workers is None:
        num_workers = env_default("PS_NUM_WORKERS", None, int)
    if worker_id is None and (num_workers or 1) > 1:
        raise ConfigError(
            f"a job of {num_workers} workers needs each worker's id: pass worker_id=, or set "
            "$PS_WORKER_ID or TF_CONFIG's task.index (two processes as one worker would have "
            "the second's pushes dropped as retries)"
        )
    for name, env, convert in (
        ("job_id", "PS_JOB_ID", str),
        ("replay_bytes", "PS_REPLAY_BYTES", int),
    ):
        if name not in options and os.environ.get(env):
            options[name] = env_default(env, None, convert)
    return PSClient(
        addresses,
        worker_id=0 if worker_id is None else worker_id,
        num_workers=1 if num_workers is None else num_workers,
        mode=mode or "sync",
        staleness=staleness,
        security=ClientSecurity.from_env(tls_ca, tls_cert, tls_key, token),
        **options,
    )
