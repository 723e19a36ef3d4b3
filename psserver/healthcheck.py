"""``python -m psserver.healthcheck [ADDR]``: exit 0 when the shard answers SERVING (for probes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.config import parse_config
from pswire import cli
from pswire.channel import OPTIONS, insecure_channel
from pswire.security import ClientSecurity, ServerSecurity

DEFAULT_TIMEOUT_S = 3.0


def probe_channel(
    address: str, server: ServerSecurity, client: tuple[Path, Path] | None = None
) -> grpc.Channel:
    """A channel to a shard configured with ``server``, from inside its own container.

    TLS checks the shard against its ``--tls-ca`` (set for mutual TLS; without it, the
    system's roots). Mutual TLS needs a client certificate: ``client`` (cert, key), else the
    shard's own, which works only when that certificate also allows client authentication.
    No token: health checks are open.

    Raises:
        ValueError: a TLS file cannot be read.
    """
    if not server.tls:
        return insecure_channel(address)
    if server.ca is not None:
        cert, key = (client or (server.cert, server.key)) if server.mutual else (None, None)
        return ClientSecurity(ca=server.ca, cert=cert, key=key).channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(), options=OPTIONS)


def check(
    address: str,
    server: ServerSecurity,
    timeout: float,
    client: tuple[Path, Path] | None = None,
    service: str = "",
) -> str:
    """The grpc.health.v1 status name that ``address`` reports for ``service``.

    Raises:
        grpc.RpcError: no answer within ``timeout``.
        ValueError: a TLS file cannot be read.
    """
    with probe_channel(address, server, client) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    """Probes ADDR (default 127.0.0.1 and the port psserver would bind from the same flags
    and PS_* variables, TLS included); returns 0 for SERVING, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m psserver.healthcheck",
        description="Exit 0 when the shard's grpc.health.v1 service answers SERVING. Reads "
        "the daemon's own PS_* variables (port, TF_CONFIG, TLS), so a container's HEALTHCHECK "
        "needs no arguments.",
    )
    parser.add_argument("address", nargs="?", help="host:port [default 127.0.0.1:PS_PORT]")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    cli.add(
        parser,
        "--client-cert",
        env="PS_PROBE_TLS_CERT",
        type=Path,
        help="mutual TLS: the probe's client certificate (else the shard's own --tls-cert)",
    )
    cli.add(parser, "--client-key", env="PS_PROBE_TLS_KEY", type=Path, help="key of --client-cert")
    args = parser.parse_args(argv)
    if (args.client_cert is None) != (args.client_key is None):
        parser.error("--client-cert and --client-key go together")
    # The daemon's own configuration: the same port and TLS files it serves with.
    config = parse_config([])
    if args.address is None and config.port == 0:
        parser.error("no address: give ADDR, or set PS_PORT or a ps task's TF_CONFIG")
    address = args.address or f"127.0.0.1:{config.port}"
    try:
        client = (args.client_cert, args.client_key) if args.client_cert else None
        status = check(address, config.security, args.timeout, client)
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"{address}: {exc}", file=sys.stderr)
        return 1
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    raise SystemExit(main())
