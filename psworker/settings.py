"""``ClientSettings``: a parameter-server worker's settings in one frozen, checked object, built
from arguments, then ``PS_*`` environment variables, then defaults, in one place.

``connect()`` builds it with ``ClientSettings.from_env`` (after finding the shards and this
worker's id from the launcher, ``psworker.launchers``); ``PSClient`` takes it; each shard's
link gets the part it needs as a ``LinkConfig`` (``link_config``). Each field's meaning,
variable and default are its metadata (``fields_table`` lists them): the SDK reference's
settings table is generated from them, so it cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pscore.job import CLIENT_MODES, MODES
from pswire.cli import env_default
from pswire.codec import COMPRESSIONS, DEFAULT_CHUNK_BYTES
from pswire.errors import ConfigError
from pswire.security import ClientSecurity
from psworker.placement import DEFAULT_PART_BYTES, DEFAULT_SPLIT_BYTES
from psworker.session import DATA_PLANES, DEFAULT_REPLAY_BYTES, GRPC_BELOW_BYTES, LinkConfig
from psworker.stall import DEFAULT_STALL_WARNING_S

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_S = 2.0  # well inside the shards' default 30 s heartbeat timeout


def _meta(doc: str, env: str = "", source: str = "") -> dict[str, str]:
    """A field's meaning (``doc``), the ``PS_*`` variable ``from_env`` reads for it (``env``),
    or where ``connect()`` finds it otherwise (``source``, for the docs)."""
    return {"doc": doc, "env": env, "source": source}


def _setting(default: Any, doc: str, env: str = "", source: str = "") -> Any:
    """A field with its default and its ``_meta``."""
    return field(default=default, metadata=_meta(doc, env, source))


_PLAINTEXT = ClientSecurity()  # frozen: one instance serves as every default
# Converters of the variables ``from_env`` reads (str when absent).
_CONVERT: dict[str, Any] = {
    "staleness": int,
    "replay_bytes": int,
    "stall_warning_s": float,
    "grpc_below_bytes": int,
    "part_bytes": int,
}


@dataclass(frozen=True)
class ClientSettings:
    """Everything a ``PSClient`` (or ``ElasticPSClient``) is built from, checked when made.

    Every field but ``addresses`` has a default; ``from_env`` fills the fields a caller left
    out from their ``PS_*`` variables. The SDK reference lists each field's meaning,
    variable and default.

    Raises:
        ConfigError: a value out of range, named with what it got (the object is not made).
    """

    addresses: tuple[str, ...] = _setting(
        (),
        "The shards' `host:port` addresses, in shard order (at least one).",
        source="`$PS_SHARDS`, `$PS_SHARDS_FILE`, `cluster.ps` of `$TF_CONFIG`",
    )
    worker_id: int = _setting(
        0,
        "This worker's id, in `[0, num_workers)`.",
        source="`$PS_WORKER_ID`, `$RANK`, `$SLURM_PROCID`, TF_CONFIG's `task.index`",
    )
    num_workers: int = _setting(
        1,
        "How many workers the job has (an elastic job: `max_workers`).",
        source="`$PS_NUM_WORKERS`, `$WORLD_SIZE`, `$SLURM_NTASKS`, TF_CONFIG's `cluster.worker`",
    )
    mode: str = _setting(
        "sync", "How the shards apply pushes: `sync`, `async` or `ssp`.", "PS_MODE"
    )
    staleness: int = _setting(
        0,
        "In `ssp`, how many steps a worker may run ahead of the slowest (0 outside `ssp`).",
        "PS_STALENESS",
    )
    timeout: float = _setting(
        DEFAULT_TIMEOUT_S, "Each call's deadline, in seconds, waits for other workers included."
    )
    retry_s: float | None = _setting(
        None, "How long a shard that is UNAVAILABLE is retried, in seconds (None: `timeout`)."
    )
    chunk_bytes: int = _setting(
        DEFAULT_CHUNK_BYTES,
        "The largest message part; a step whose share fits travels as one message each way.",
    )
    split_bytes: int = _setting(
        DEFAULT_SPLIT_BYTES, "Variables larger than this are split by rows across the shards."
    )
    part_bytes: int = _setting(
        DEFAULT_PART_BYTES,
        "Variables larger than this are also cut by rows into parts of about this size (at "
        "most 64), so an overlapped step's weights come back part by part (try 1 MiB where "
        "the link is slower than backward); 0: never.",
        "PS_PART_BYTES",
    )
    security: ClientSecurity = field(
        default=_PLAINTEXT,
        metadata=_meta(
            "TLS files and token for every shard (`tls_ca`, `tls_cert`, `tls_key`, `token` of "
            "`connect()`); the default is plaintext without a token.",
            source="`$PS_TLS_CA`, `$PS_TLS_CERT`, `$PS_TLS_KEY`, `$PS_TOKEN`, `$PS_TOKEN_FILE`",
        ),
    )
    quorum: int = _setting(
        0, "In `sync`, a step closes once this many workers pushed (backup workers; 0: all)."
    )
    heartbeat_s: float = _setting(
        DEFAULT_HEARTBEAT_S,
        "Seconds between heartbeats (0: none); lowered to a quarter of a shorter shard timeout.",
    )
    interceptors: tuple[grpc.UnaryUnaryClientInterceptor, ...] = _setting(
        (), "gRPC client interceptors put on every shard's channel."
    )
    compression: str | None = _setting(
        None,
        "`fp16` or `bf16`: float32 gradients travel in 16 bits (None: as they are).",
        "PS_COMPRESSION",
    )
    job_id: str = _setting(
        "", "Fixes the job's identity (empty: worker 0 proposes one).", "PS_JOB_ID"
    )
    replay_bytes: int = _setting(
        DEFAULT_REPLAY_BYTES,
        "The bytes of pushes kept per shard to replay after it restarts.",
        "PS_REPLAY_BYTES",
    )
    stall_warning_s: float = _setting(
        DEFAULT_STALL_WARNING_S,
        "How often a step that waits for other workers logs who it waits for (0: never).",
        "PS_STALL_WARNING",
    )
    data_plane: str = _setting(
        "auto",
        "How tensors travel: `auto` uses a shard's Flight data port when it serves one, `grpc` "
        "never does (the control port's grpcio calls).",
        "PS_DATA_PLANE",
    )
    grpc_below_bytes: int = _setting(
        GRPC_BELOW_BYTES,
        "Calls moving fewer tensor bytes than this each way travel in grpcio's message form "
        "(a step in one message each way on the shard's data port, else on grpcio), where it "
        "measured faster (0: record batches on the data port for every size).",
        "PS_GRPC_BELOW_BYTES",
    )
    min_workers: int = _setting(
        0, "An elastic job's fewest members (0: a job of fixed size).", source="`$PS_ELASTIC`"
    )
    max_workers: int = _setting(
        0, "An elastic job's most members (0: a job of fixed size).", source="`$PS_ELASTIC`"
    )

    def __post_init__(self) -> None:
        # Sequences become tuples: a frozen object holds nothing a caller can change after.
        object.__setattr__(self, "addresses", tuple(self.addresses))
        object.__setattr__(self, "interceptors", tuple(self.interceptors))
        if not self.addresses:
            raise ConfigError("connect needs at least one shard address")
        if self.elastic:
            if not 1 <= self.min_workers <= self.max_workers:
                raise ConfigError(
                    "an elastic job needs 1 <= min_workers <= max_workers, got "
                    f"{self.min_workers}:{self.max_workers}"
                )
            if not 0 <= self.worker_id < self.max_workers:
                raise ConfigError(
                    f"worker_id {self.worker_id} must be in [0, max_workers={self.max_workers}) "
                    "in an elastic job"
                )
            if self.num_workers != self.max_workers:
                raise ConfigError(
                    f"an elastic job's num_workers is its max_workers ({self.max_workers}), got "
                    f"num_workers={self.num_workers}"
                )
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.worker_id < self.num_workers:
            raise ConfigError(f"worker_id {self.worker_id} must be in [0, {self.num_workers})")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"compression must be one of {COMPRESSIONS}, got {self.compression!r}"
            )
        if self.mode == "ssp" and self.staleness < 0:
            raise ConfigError(f"staleness must be >= 0, got {self.staleness}")
        if self.mode != "ssp":
            object.__setattr__(self, "staleness", 0)  # only ssp has a staleness bound
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(f"data_plane must be one of {DATA_PLANES}, got {self.data_plane!r}")
        if self.grpc_below_bytes < 0:
            raise ConfigError(f"grpc_below_bytes must be >= 0, got {self.grpc_below_bytes}")
        for name in ("timeout", "chunk_bytes", "split_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.part_bytes >= 0:
            raise ConfigError(f"part_bytes must be >= 0, got {self.part_bytes!r}")

    @property
    def elastic(self) -> bool:
        """Whether the job is elastic (``max_workers`` set)."""
        return bool(self.min_workers or self.max_workers)

    @property
    def retry_for(self) -> float:
        """How long UNAVAILABLE is retried: ``retry_s``, else ``timeout``."""
        return self.timeout if self.retry_s is None else self.retry_s

    def link_config(self, session: str) -> LinkConfig:
        """What each shard's link of this worker's process ``session`` is given."""
        return LinkConfig(
            self.worker_id,
            self.num_workers,
            self.timeout,
            self.retry_for,
            self.chunk_bytes,
            session,
            self.replay_bytes,
            self.data_plane,
            self.grpc_below_bytes,
        )

    @classmethod
    def from_env(
        cls,
        addresses: Sequence[str],
        worker_id: int,
        num_workers: int,
        *,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
        **given: Any,
    ) -> ClientSettings:
        """Arguments, then ``PS_*`` variables, then defaults: a setting in ``given`` (not
        None) is taken as is; one left out takes its variable's value when that is set and
        not empty (``mode`` from ``$PS_MODE``, ``staleness`` from ``$PS_STALENESS``, ...: the
        reference's table), else its default. ``security`` is built from ``tls_*``/``token``
        and their variables unless given.

        Raises:
            ConfigError: an unknown setting, a variable that does not convert (the message
                names it and its value), or a value the constructor refuses.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(
                f"unknown client settings {unknown}; the settings are {sorted(known)}"
            )
        values = {name: value for name, value in given.items() if value is not None}
        values["mode"] = resolve_mode(values.get("mode")) or "sync"
        for name in known - set(values):
            found = setting_from_env(name)
            if found is not None:
                values[name] = found
        if "security" not in values:
            values["security"] = ClientSecurity.from_env(tls_ca, tls_cert, tls_key, token)
        return cls(
            addresses=tuple(addresses), worker_id=worker_id, num_workers=num_workers, **values
        )


def setting_from_env(name: str) -> Any:
    """The value of setting ``name``'s ``PS_*`` variable, converted (None: the setting has
    none, or it is unset or empty).

    Raises:
        ConfigError: the variable does not convert; the message names it and its value.
    """
    env = _ENV.get(name, "")
    if not env:
        return None
    if name == "mode":
        return resolve_mode(None)
    return env_default(env, None, _CONVERT.get(name, str))


def resolve_mode(mode: str | None) -> str | None:
    """``mode``, else ``$PS_MODE`` (None: neither says): a client mode, checked.

    Raises:
        ConfigError: not one of the client modes (``sync``, ``async``, ``ssp``,
            ``allreduce``, ``local``), naming where it came from.
    """
    found = mode or os.environ.get("PS_MODE") or None
    if found is not None and found not in CLIENT_MODES:
        source = "mode" if mode else "$PS_MODE"
        raise ConfigError(f"{source}={found!r} is not a mode; expected one of {list(CLIENT_MODES)}")
    return found


def fields_table() -> list[tuple[str, str, str, str]]:
    """(field, where connect() finds it when not given, default, meaning) for every field of
    ``ClientSettings``, in order: what the reference's settings table shows."""
    rows = []
    for f in dataclasses.fields(ClientSettings):
        meta: Mapping[str, str] = f.metadata
        where = f"`${meta['env']}`" if meta["env"] else meta["source"]
        rows.append((f.name, where, _shown(f.name, f.default), meta["doc"]))
    return rows


def _shown(name: str, default: Any) -> str:
    """A default as the reference shows it (sizes in MiB; nothing for empty ones)."""
    if default in ((), "", None) or isinstance(default, ClientSecurity):
        return ""
    if name.endswith("_bytes") and default % (1 << 20) == 0:
        return f"{default >> 20} MiB"
    return f"`{default!r}`"


_ENV: dict[str, str] = {f.name: f.metadata["env"] for f in dataclasses.fields(ClientSettings)}
