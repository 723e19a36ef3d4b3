"""Builds and runs a shard's gRPC server with the health service beside it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.admission import (
    DEFAULT_STREAM_IDLE_S,
    DEFAULT_STREAMS_PER_WORKER,
    DEFAULT_THREADS,
    Admission,
)
from psserver.flight_service import RunningFlightService, start_flight_service
from psserver.metrics import RpcMetricsInterceptor, ShardMetrics
from psserver.parsing import tolerant
from psserver.servicer import ParameterServerServicer
from psserver.shard import Shard
from pswire.channel import OPTIONS, WILDCARD_HOSTS
from pswire.security import ServerSecurity, TokenInterceptor
from pswire.stubs import SERVICE, add_servicer


class _ExpiryTicker:
    """Drops silent workers on a timer (``Shard.expire_silent``), so membership is current
    even when no call waits; reads such as status never do it themselves."""

    def __init__(self, shard: Shard) -> None:
        hb = shard.limits.heartbeat_timeout_s
        self._shard = shard
        self._tick = min(1.0, hb / 4) if hb > 0 else 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-expiry", daemon=True)

    def start(self) -> None:
        if self._tick > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._shard.expire_silent()


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    shard: Shard
    health: health.HealthServicer
    host: str = "127.0.0.1"
    admission: Admission | None = None
    ticker: _ExpiryTicker | None = None
    data: RunningFlightService | None = None  # the Flight data port (None: off)

    @property
    def data_port(self) -> int:
        """The Flight data port's number (0: none)."""
        return self.data.port if self.data is not None else 0

    @property
    def address(self) -> str:
        """Where clients reach it (loopback when bound to every interface)."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        """Stops serving: every wait in the shard ends at once (its callers hear the shard is
        stopping), then calls in flight get ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        self.shard.close()
        stopped = self.server.stop(grace)
        if self.data is not None:
            self.data.stop(grace)  # gives up after grace: an exchange kept open ends at exit
        stopped.wait(grace + 1.0)
        for part in (self.ticker, self.admission):
            if part is not None:
                part.stop()


def start_server(
    shard: Shard | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    threads: int = DEFAULT_THREADS,
    security: ServerSecurity | None = None,
    checkpoint: Callable[[], tuple[str, int]] | None = None,
    metrics: ShardMetrics | None = None,
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
    streams_per_worker: int = DEFAULT_STREAMS_PER_WORKER,
    max_inflight_bytes: int = 0,
    data_port: int | None = 0,
) -> RunningServer:
    """Starts a shard server bound to ``host:port`` (0 picks a free port) and returns it.

    ``threads`` bounds concurrent RPCs; a worker's step stream and a waiting pull hold one
    each, and 8 are kept for short calls, so it must be at least twice the workers plus 8.
    ``security`` turns on TLS (mutual when it names a CA) and the token check; health checks
    answer without a token. ``checkpoint`` saves one checkpoint and returns (path, shard
    clock), for the Checkpoint RPC; None: the RPC fails. ``metrics`` (of this ``shard``) counts
    and times every call; an empty name becomes host:port (the machine's name for a wildcard
    host). A request stream idle, or a reply left untaken, for ``stream_idle_s`` is cancelled;
    a worker holds at most ``streams_per_worker`` open step streams; requests arriving at once
    declare at most ``max_inflight_bytes`` (0: no bound beyond each one's limit).
    ``data_port``: the Arrow Flight data port for tensor bytes on the same host (0: a free
    port; None: none, tensors then travel on this port's grpcio calls), with the same
    security and limits; workers learn it from RegisterWorker.

    Raises:
        RuntimeError: the address could not be bound.
        ValueError: a TLS file cannot be read.
        OSError: the data port could not be bound.
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
    admission = Admission(
        threads, stream_idle_s, streams_per_worker, max_inflight_bytes=max_inflight_bytes
    )
    servicer = ParameterServerServicer(shard, checkpoint=checkpoint, admission=admission)
    add_servicer(servicer, server, wrap=lambda m, h: admission.wrap(m, tolerant(m, h)))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if credentials is not None:
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    data: RunningFlightService | None = None
    if data_port is not None:
        try:
            data = start_flight_service(
                shard, host, data_port, security, admission=admission, metrics=metrics
            )
        except Exception as exc:
            server.stop(0)
            raise RuntimeError(
                f"could not start the data port on {host}:{data_port}: {exc}"
            ) from None
        servicer.data_port = data.port
    if metrics is not None and not metrics.name:
        # Set before the first call, so every sample carries it; a wildcard bind is named by
        # the machine, as "0.0.0.0" would not tell two shards apart.
        wildcard = host in WILDCARD_HOSTS
        metrics.name = f"{socket.gethostname() if wildcard else host}:{bound}"
    server.start()
    admission.start()
    ticker = _ExpiryTicker(shard)
    ticker.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, shard, health_servicer, host, admission, ticker, data)
