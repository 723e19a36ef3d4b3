"""Builds and runs a shard's gRPC server with the health service beside it."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.servicer import ParameterServerServicer
from psserver.shard import Shard
from pswire.channel import OPTIONS
from pswire.proto import ps_pb2_grpc

SERVICE_NAME = "pswire.v1.ParameterServer"


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
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)


def start_server(
    shard: Shard | None = None, host: str = "127.0.0.1", port: int = 0, threads: int = 64
) -> RunningServer:
    """Starts a shard server bound to ``host:port`` (0 picks a free port) and returns it.

    ``threads`` bounds concurrent RPCs; waiting pulls and pushes each hold one, so it must
    exceed twice the number of workers.

    Raises:
        RuntimeError: the address could not be bound.
    """
    shard = shard or Shard()
    # SO_REUSEPORT off: a second shard on a taken port must fail, not split the traffic.
    options = [*OPTIONS, ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=options)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(shard), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, shard, health_servicer, host)
