"""The psserver daemon's configuration: flags and PS_* variables, validated once."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path

from psserver.shard import Limits
from pswire import cli
from pswire.cluster import ClusterSpec

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_DEFAULT_LIMITS = Limits()
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Everything one shard daemon needs; ``__post_init__`` rejects impossible values."""

    host: str = "0.0.0.0"
    port: int = 0
    port_file: Path | None = None
    threads: int = 64
    limits: Limits = field(default_factory=Limits)
    grace_s: float = 5.0
    log_level: str = "INFO"

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
        if not self.limits.max_wait_s > 0:
            problems.append(f"max-wait must be > 0 seconds, got {self.limits.max_wait_s}")
        if not self.grace_s >= 0:
            problems.append(f"grace must be >= 0 seconds, got {self.grace_s}")
        if self.log_level not in LOG_LEVELS:
            problems.append(f"log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if problems:
            raise ValueError("; ".join(problems))


def build_parser() -> argparse.ArgumentParser:
    """The ``psserver`` argument parser; every flag has a PS_* environment twin."""
    parser = argparse.ArgumentParser(
        prog="psserver",
        description="Run one parameter-server shard (gRPC, with grpc.health.v1 beside it).",
    )
    cli.add(parser, "--host", env="PS_HOST", default="0.0.0.0", help="address to bind")
    cli.add(
        parser,
        "--port",
        env="PS_PORT",
        type=int,
        help="port to bind; 0 picks a free one; unset: this task's port in --cluster, else 0",
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
        default=64,
        help="concurrent RPCs; waiting pulls and pushes hold one each, so > 2x workers",
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
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Flags over PS_* variables over defaults, validated; exits with usage on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        port = args.port if args.port is not None else 0
        if args.port is None or args.cluster is not None:
            cluster_port = _port_from_cluster(args.cluster)
            if args.port is None and cluster_port is not None:
                port = cluster_port
        return ServerConfig(
            host=args.host,
            port=port,
            port_file=args.port_file,
            threads=args.threads,
            limits=Limits(
                max_workers=args.max_workers,
                max_variables=args.max_variables,
                max_request_bytes=args.max_request_bytes,
                max_wait_s=args.max_wait,
            ),
            grace_s=args.grace,
            log_level=args.log_level,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _port_from_cluster(source: str | None) -> int | None:
    """This task's port when the cluster spec says it is a ps task, else None.

    Raises:
        ValueError: malformed spec, index out of range, or an address without a port.
    """
    spec = ClusterSpec.load(source)
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
    return int(port)
