"""The psserver daemon's configuration: flags and PS_* variables, validated once."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from psserver.admission import DEFAULT_STREAM_IDLE_S, DEFAULT_THREADS
from psserver.records import Limits
from pswire import cli
from pswire.cluster import ClusterSpec
from pswire.security import ServerSecurity, read_token_file

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
_DEFAULT_LIMITS = Limits()
# A shorter heartbeat timeout would have every worker heartbeat this shard many times a second.
MIN_HEARTBEAT_TIMEOUT_S = 1.0
log = logging.getLogger(__name__)
# Without TLS or a token anyone reaching the port may read or train the model: unless the
# operator names the address, such a daemon serves only this machine (as /metrics does).
LOOPBACK_HOST = "127.0.0.1"
WILDCARD_HOST = "0.0.0.0"


def default_host(security: ServerSecurity) -> str:
    """Where a daemon started without ``--host`` listens: every interface when TLS or a token
    guards it, else only this machine."""
    return WILDCARD_HOST if security.tls or security.token else LOOPBACK_HOST


@dataclass(frozen=True)
class ServerConfig:
    """Everything one shard daemon needs; ``__post_init__`` rejects impossible values."""

    host: str = LOOPBACK_HOST
    host_given: bool = True  # False: ``host`` is ``default_host``'s choice (logged at start)
    port: int = 0
    port_file: Path | None = None
    threads: int = DEFAULT_THREADS
    limits: Limits = field(default_factory=Limits)
    grace_s: float = 5.0
    log_level: str = "INFO"
    security: ServerSecurity = field(default_factory=ServerSecurity)
    checkpoint_dir: Path | None = None
    checkpoint_every_steps: int = 0
    checkpoint_every_secs: float = 0.0
    keep_checkpoints: int = 3
    fresh: bool = False  # set the folder's checkpoints aside and start a new job
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port
    log_format: str = "text"
    shard_name: str = ""  # the ``shard`` label of its metrics; empty: host:port
    metrics_host: str = "127.0.0.1"  # /metrics has no token: exposing it is a choice
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S
    max_inflight_bytes: int = 0
    # The Arrow Flight data port for tensor bytes (docs/flight.md): 0 any free port, None off.
    data_port: int | None = 0

    def __post_init__(self) -> None:
        problems = []
        if not self.host:
            problems.append("host must not be empty")
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in [0, 65535], got {self.port}")
        if self.threads < 1:
            problems.append(f"threads must be >= 1, got {self.threads}")
        if self.limits.max_workers < 1:
            problems.append(f"max-workers must be >= 1, got {self.limits.max_workers}")
        if self.limits.max_variables < 1:
            problems.append(f"max-variables must be >= 1, got {self.limits.max_variables}")
        if self.limits.max_request_bytes < 1:
            problems.append(f"max-request-bytes must be >= 1, got {self.limits.max_request_bytes}")
        timeout = self.limits.heartbeat_timeout_s
        if not (timeout == 0 or timeout >= MIN_HEARTBEAT_TIMEOUT_S):
            problems.append(
                f"heartbeat-timeout must be 0 (never drop a worker) or >= "
                f"{MIN_HEARTBEAT_TIMEOUT_S:g} seconds, got {timeout} (workers beat four times "
                "per timeout)"
            )
        if not self.limits.max_wait_s > 0:
            problems.append(f"max-wait must be > 0 seconds, got {self.limits.max_wait_s}")
        if not self.grace_s >= 0:
            problems.append(f"grace must be >= 0 seconds, got {self.grace_s}")
        if self.checkpoint_every_steps < 0:
            problems.append(
                f"checkpoint-every-steps must be >= 0, got {self.checkpoint_every_steps}"
            )
        if not self.checkpoint_every_secs >= 0:
            problems.append(f"checkpoint-every-secs must be >= 0, got {self.checkpoint_every_secs}")
        if self.keep_checkpoints < 1:
            problems.append(f"keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.checkpoint_dir is None and (
            self.checkpoint_every_steps or self.checkpoint_every_secs
        ):
            problems.append("checkpoint intervals need a checkpoint-dir to write to")
        if self.fresh and self.checkpoint_dir is None:
            problems.append(
                "fresh sets aside the checkpoints of a checkpoint-dir; without one every start "
                "is fresh"
            )
        if self.data_port is not None and not 0 <= self.data_port <= 65535:
            problems.append(f"data-port must be in [0, 65535] or off, got {self.data_port}")
        if self.data_port and self.data_port == self.port:
            problems.append(f"data-port must differ from port, both are {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.log_format not in LOG_FORMATS:
            problems.append(f"log-format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            problems.append(f"log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.limits.max_step_ahead < 0:
            problems.append(f"max-step-ahead must be >= 0, got {self.limits.max_step_ahead}")
        if self.limits.memory_limit_bytes < 0:
            problems.append(f"memory-limit must be >= 0, got {self.limits.memory_limit_bytes}")
        if not self.stream_idle_s >= 0:
            problems.append(f"stream-idle-timeout must be >= 0 seconds, got {self.stream_idle_s}")
        if problems:
            raise ValueError("; ".join(problems))


def build_parser() -> argparse.ArgumentParser:
    """The ``psserver`` argument parser; every flag has a PS_* environment twin."""
    parser = argparse.ArgumentParser(
        prog="psserver",
        description="Run one parameter-server shard (gRPC, with grpc.health.v1 beside it).",
    )
    cli.add(
        parser,
        "--host",
        env="PS_HOST",
        help=f"address to bind; unset: {WILDCARD_HOST} with TLS or a token, else {LOOPBACK_HOST} "
        f"(this machine only: pass --host {WILDCARD_HOST} to serve others without either)",
    )
    cli.add(
        parser,
        "--port",
        env="PS_PORT",
        type=int,
        help="port to bind; 0 picks a free one; unset: this task's port in --cluster, else 0",
    )
    cli.add(
        parser,
        "--data-port",
        env="PS_DATA_PORT",
        type=data_port,
        default=0,
        help="the Arrow Flight data port carrying tensor bytes (workers learn it when they "
        "register); 0 picks a free one; 'off': none (tensors travel on --port's grpcio calls)",
    )
    cli.add(
        parser,
        "--port-file",
        env="PS_PORT_FILE",
        type=Path,
        help="write the bound port here (atomically) once serving, for launchers using port 0",
    )
    cli.add(
        parser,
        "--cluster",
        env="PS_CLUSTER",
        help="TF_CONFIG JSON or a file holding it (else $TF_CONFIG); only names this task's port",
    )
    cli.add(
        parser,
        "--threads",
        env="PS_THREADS",
        type=int,
        default=DEFAULT_THREADS,
        help="concurrent RPCs; a worker's step stream and a waiting pull hold one each, and 8 "
        "are kept for status and health: at least 2 x workers + 8",
    )
    cli.add(
        parser,
        "--max-request-bytes",
        env="PS_MAX_REQUEST_BYTES",
        type=int,
        default=_DEFAULT_LIMITS.max_request_bytes,
        help="largest init or push stream accepted",
    )
    cli.add(
        parser,
        "--memory-limit",
        env="PS_MEMORY_LIMIT",
        type=int,
        default=None,
        help="bytes a job's state may take on this shard: variables, optimizer slots, table "
        "rows at their bound; a larger job is refused at init [default: this machine's memory]",
    )
    cli.add(
        parser,
        "--table-files",
        env="PS_TABLE_FILES",
        default=_DEFAULT_LIMITS.table_files,
        help="the folder (with its subfolders) whose files an embedding table may start from "
        "(a worker's Table(init_from=...)); a file elsewhere is refused [default: the working "
        "directory]",
    )
    cli.add(
        parser,
        "--max-inflight-bytes",
        env="PS_MAX_INFLIGHT_BYTES",
        type=int,
        default=None,
        help="bytes all requests arriving at once may declare; more is refused until some "
        "finish [default: a quarter of this machine's memory]",
    )
    cli.add(
        parser,
        "--max-step-ahead",
        env="PS_MAX_STEP_AHEAD",
        type=int,
        default=_DEFAULT_LIMITS.max_step_ahead,
        help="steps a push may be ahead of the one its worker is expected to push next",
    )
    cli.add(
        parser,
        "--stream-idle-timeout",
        env="PS_STREAM_IDLE_TIMEOUT",
        type=float,
        default=DEFAULT_STREAM_IDLE_S,
        help="seconds a request stream may sit without a message before it is cancelled (0: never)",
    )
    cli.add(
        parser,
        "--max-workers",
        env="PS_MAX_WORKERS",
        type=int,
        default=_DEFAULT_LIMITS.max_workers,
        help="largest num_workers a job may declare",
    )
    cli.add(
        parser,
        "--max-variables",
        env="PS_MAX_VARIABLES",
        type=int,
        default=_DEFAULT_LIMITS.max_variables,
        help="most variables a job may place on this shard",
    )
    cli.add(
        parser,
        "--max-wait",
        env="PS_MAX_WAIT",
        type=float,
        default=_DEFAULT_LIMITS.max_wait_s,
        help="seconds a pull or push may wait for the consistency rule",
    )
    cli.add(
        parser,
        "--heartbeat-timeout",
        env="PS_HEARTBEAT_TIMEOUT",
        type=float,
        default=_DEFAULT_LIMITS.heartbeat_timeout_s,
        help="seconds a silent worker stays in the sync/ssp quorum (0: forever; else >= 1)",
    )
    cli.add(
        parser,
        "--grace",
        env="PS_GRACE",
        type=float,
        default=5.0,
        help="seconds in-flight RPCs get to finish on SIGTERM/SIGINT",
    )
    cli.add(
        parser,
        "--log-level",
        env="PS_LOG_LEVEL",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="logging threshold",
    )
    cli.add(
        parser,
        "--log-format",
        env="PS_LOG_FORMAT",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or json: one JSON object per line for log collectors",
    )
    cli.add(
        parser,
        "--metrics-port",
        env="PS_METRICS_PORT",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:PORT/metrics; 0: off",
    )
    cli.add(
        parser,
        "--metrics-host",
        env="PS_METRICS_HOST",
        default="127.0.0.1",
        help="address /metrics listens on; it has no token, so it serves only this machine "
        "unless you choose otherwise (the images use 0.0.0.0)",
    )
    cli.add(
        parser,
        "--shard-name",
        env="PS_SHARD_NAME",
        default="",
        help="the shard label of its metrics; unset: psN for ps task N of --cluster, else "
        "host:port",
    )
    cli.add(parser, "--tls-cert", env="PS_TLS_CERT", type=Path, help="PEM certificate: serve TLS")
    cli.add(parser, "--tls-key", env="PS_TLS_KEY", type=Path, help="PEM key of --tls-cert")
    cli.add(
        parser,
        "--tls-ca",
        env="PS_TLS_CA",
        type=Path,
        help="PEM CA certificate: require client certificates it signed (mutual TLS)",
    )
    # Health checks stay open without the token so orchestrators can probe (pswire/security.py).
    cli.add(
        parser,
        "--token",
        env="PS_TOKEN",
        help="shared token every call but health checks must carry; prefer --token-file or "
        "PS_TOKEN, since command lines are visible to every user of the host",
    )
    cli.add(parser, "--token-file", env="PS_TOKEN_FILE", type=Path, help="file holding the token")
    cli.add(
        parser,
        "--checkpoint-dir",
        env="PS_CHECKPOINT_DIR",
        type=Path,
        help="this shard's own checkpoint folder: resume from its newest valid checkpoint on "
        "start, save there on SIGTERM and on request; unset: no checkpoints",
    )
    cli.add(
        parser,
        "--checkpoint-every-steps",
        env="PS_CHECKPOINT_EVERY_STEPS",
        type=int,
        default=0,
        help="also save whenever the shard clock advanced this many steps; 0: off",
    )
    cli.add(
        parser,
        "--checkpoint-every-secs",
        env="PS_CHECKPOINT_EVERY_SECS",
        type=float,
        default=0.0,
        help="also save this often (seconds) when anything changed; 0: off",
    )
    cli.add(
        parser,
        "--keep-checkpoints",
        env="PS_KEEP_CHECKPOINTS",
        type=int,
        default=3,
        help="newest checkpoints kept; older ones are deleted",
    )
    cli.add(
        parser,
        "--fresh",
        env="PS_FRESH",
        action="store_true",
        help="start a new job: move the checkpoint folder's checkpoints into a subfolder "
        "before-fresh-<time> (kept, never deleted) instead of resuming from them",
    )
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Flags over PS_* variables over defaults, validated; exits with usage on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.token is not None and args.token_file is not None:
            raise ValueError("give the token once: --token/PS_TOKEN or --token-file/PS_TOKEN_FILE")
        port = args.port if args.port is not None else 0
        shard_name = args.shard_name
        if args.port is None or args.cluster is not None:
            task = _ps_task(args.cluster)
            if args.port is None and task is not None:
                port = task[1]
            if not shard_name and task is not None:
                shard_name = f"ps{task[0]}"
        security = ServerSecurity(
            cert=args.tls_cert,
            key=args.tls_key,
            ca=args.tls_ca,
            token=read_token_file(args.token_file) if args.token_file else args.token,
        )
        return ServerConfig(
            host=args.host if args.host is not None else default_host(security),
            host_given=args.host is not None,
            port=port,
            port_file=args.port_file,
            threads=args.threads,
            limits=Limits(
                max_workers=args.max_workers,
                max_variables=args.max_variables,
                max_request_bytes=args.max_request_bytes,
                max_wait_s=args.max_wait,
                heartbeat_timeout_s=args.heartbeat_timeout,
                max_step_ahead=args.max_step_ahead,
                memory_limit_bytes=(
                    physical_memory() if args.memory_limit is None else args.memory_limit
                ),
                table_files=args.table_files,
            ),
            grace_s=args.grace,
            log_level=args.log_level,
            security=security,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every_steps=args.checkpoint_every_steps,
            checkpoint_every_secs=args.checkpoint_every_secs,
            keep_checkpoints=args.keep_checkpoints,
            fresh=args.fresh,
            # The flag's 0 means off, as an unset PS_METRICS_PORT does.
            metrics_port=args.metrics_port or None,
            log_format=args.log_format,
            shard_name=shard_name,
            metrics_host=args.metrics_host,
            stream_idle_s=args.stream_idle_timeout,
            data_port=args.data_port,
            max_inflight_bytes=(
                physical_memory() // 4
                if args.max_inflight_bytes is None
                else args.max_inflight_bytes
            ),
        )
    except ValueError as exc:
        parser.error(str(exc))


def data_port(text: str) -> int | None:
    """``--data-port``'s value: a port number, or None for 'off'.

    Raises:
        ValueError: neither (argparse reports it as a bad value).
    """
    if text.strip().lower() == "off":
        return None
    return int(text)


def physical_memory() -> int:
    """This machine's memory in bytes (0 when it cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _ps_task(source: str | None) -> tuple[int, int] | None:
    """(index, port) of this task when the cluster spec says it is a ps task, else None.

    A spec without a task (one spec for every pod) takes the index from the environment
    (``pswire.cluster.task_index_from_env``: $PS_TASK_INDEX, $JOB_COMPLETION_INDEX, or a
    StatefulSet hostname's ordinal).

    Raises:
        ValueError: malformed spec, index out of range, or an address without a port.
    """
    spec = ClusterSpec.load(source, role="ps")
    if spec is None:
        return None
    if spec.task_type != "ps":
        # A worker's TF_CONFIG leaking into a shard's environment is harmless: ignore it.
        log.debug("cluster spec names a %r task, not ps; not using its port", spec.task_type)
        return None
    if not 0 <= spec.task_index < len(spec.ps):
        raise ValueError(
            f"cluster spec names ps task {spec.task_index}, but lists {len(spec.ps)} ps addresses"
        )
    address = spec.ps[spec.task_index]
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"ps address {address!r} in the cluster spec has no port")
    return spec.task_index, int(port)
