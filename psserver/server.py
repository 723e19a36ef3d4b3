"""Builds and runs a shard's gRPC server with the health service beside it."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.metrics import RpcMetricsInterceptor, ShardMetrics
from psserver.parsing import tolerant
from psserver.servicer import ParameterServerServicer
from psserver.shard import Shard
from pswire.channel import OPTIONS, WILDCARD_HOSTS
from pswire.security import ServerSecurity, TokenInterceptor
from pswire.stubs import SERVICE, add_servicer


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    shard: Shard
    health: health.HealthServicer

    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        """Where clients reach it (loopback when bound to every interface)."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)


def start_server(
    shard: Shard | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    threads: int = 64,
    security: ServerSecurity | None = None,
    checkpoint: Callable[[], tuple[str, int]] | None = None,
    metrics: ShardMetrics | None = None,
) -> RunningServer:
    """Starts a shard server bound to ``host:port`` (0 picks a free port) and returns it.

    ``threads`` bounds concurrent RPCs; waiting pulls and pushes each hold one, so it must
    exceed twice the number of workers. ``security`` turns on TLS (mutual when it names a CA)
    and the token check; health checks answer without a token. ``checkpoint`` saves one
    checkpoint and returns (path, shard clock), for the Checkpoint RPC; None: the RPC fails.
    ``metrics`` (of this ``shard``) counts and times every call; an empty name becomes
    host:port (the machine's name for a wildcard host).

    Raises:
        RuntimeError: the address could not be bound.
        ValueError: a TLS file cannot be read.
    """
    shard = shard or Shard()
    # SO_REUSEPORT off: a second shard on a taken port must fail, not split the traffic.
    options = [*OPTIONS, ("grpc.so_reuseport", 0)]
    security = security or ServerSecurity()
    # Credentials are read before anything binds, so a bad file fails the start cleanly.
    credentials = security.credentials() if security.tls else None
    # The token check runs first, so an unauthenticated caller's bytes are never even parsed.
    interceptors: list[grpc.ServerInterceptor] = []
    if security.token:
        interceptors.append(TokenInterceptor(security.token))
    if metrics is not None:
        # Outermost, so refused and malformed calls are timed and counted as well.
        interceptors.insert(0, RpcMetricsInterceptor(metrics))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads),
        options=options,
        interceptors=interceptors,
    )
    if metrics is not None:
        shard.observer = metrics  # counts gradients, snapshots and time spent in the shard
    servicer = ParameterServerServicer(shard, checkpoint=checkpoint)
    add_servicer(servicer, server, wrap=tolerant)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if credentials is not None:
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    if metrics is not None and not metrics.name:
        # Set before the first call, so every sample carries it; a wildcard bind is named by
        # the machine, as "0.0.0.0" would not tell two shards apart.
        wildcard = host in WILDCARD_HOSTS
        metrics.name = f"{socket.gethostname() if wildcard else host}:{bound}"
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, shard, health_servicer, host)
