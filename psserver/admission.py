"""Keeps a shard answerable under any load: calls that can last are capped below the thread pool,
so status, health and registration always find a thread; a request stream that sits idle, or
a reply the client does not take, is cancelled; each worker has at most a few open step
streams, and each peer at most a few request streams that have not said who they are."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from psserver.handlers import rewrapped
from pswire.errors import ERROR_CLASS_KEY, ShardBusyError, TooLargeError

log = logging.getLogger(__name__)

# Calls that may hold a server thread for long: they wait on the consistency rule or stream.
LONG_CALLS = frozenset(
    {"Init", "Pull", "Push", "PushPull", "PushPullStream", "PullState", "LoadState"}
)
# Calls whose requests stream in, and may stop arriving.
REQUEST_STREAMS = frozenset({"Init", "Push", "PushPullStream", "LoadState"})
# Threads kept for short calls (status, health, registration, heartbeats, checkpoints).
RESERVED_THREADS = 8
DEFAULT_STREAM_IDLE_S = 120.0
# A shard's gRPC threads: room for 60 workers (a step stream and a pull each) and the reserve.
DEFAULT_THREADS = 128
DEFAULT_STREAMS_PER_WORKER = 2
# A request stream names its worker in its first message, which a worker sends at once; until
# then it is anonymous. A peer (host) holding more than this many anonymous streams for over
# ANONYMOUS_GRACE_S has the oldest cancelled: a client that opens streams and sends nothing
# holds a few threads, not all, while real workers' streams are never anonymous for long.
ANONYMOUS_STREAMS_PER_PEER = 2
ANONYMOUS_GRACE_S = 5.0
_WATCH_TICK_S = 0.5
# How long a worker's step stream over the limit waits for one of its others to end.
STREAM_GRACE_S = 2.0


class Admission:
    """The limits above, for one server with ``threads`` threads.

    ``stream_idle_s``: a request stream with no message for this long is cancelled (0: never).
    ``streams_per_worker``: open ``PushPullStream`` calls one worker id may hold.
    """

    def __init__(
        self,
        threads: int,
        stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
        streams_per_worker: int = DEFAULT_STREAMS_PER_WORKER,
        clock: Callable[[], float] = time.monotonic,
        max_inflight_bytes: int = 0,
    ) -> None:
        reserved = min(RESERVED_THREADS, max(1, threads // 2))
        self.long_limit = max(1, threads - reserved)
        self.stream_idle_s = stream_idle_s
        self.streams_per_worker = streams_per_worker
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight = 0
        self._now = clock
        self._lock = threading.Lock()
        self._stream_freed = threading.Condition(self._lock)  # a step stream was released
        self._long = 0
        self._streams: dict[int, int] = {}
        self._idle: dict[int, tuple[float, grpc.ServicerContext]] = {}
        # Request streams whose first message has not come: call -> (peer host, since, context).
        self._anonymous: dict[int, tuple[str, float, grpc.ServicerContext]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- the stream watchdog ---------------------------------------------------------------

    def start(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name="ps-idle-streams", daemon=True
            )
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)

    def _watch(self) -> None:
        while not self._stop.wait(_WATCH_TICK_S):
            self.expire(self._now())

    def expire(self, now: float) -> None:
        """Cancels the request streams idle for over ``stream_idle_s`` and each peer's
        anonymous streams past ``ANONYMOUS_STREAMS_PER_PEER`` held for over
        ``ANONYMOUS_GRACE_S`` (the oldest first); the watchdog calls it every tick."""
        with self._lock:
            idle = []
            if self.stream_idle_s > 0:
                idle = [
                    (call, context)
                    for call, (since, context) in self._idle.items()
                    if now - since > self.stream_idle_s
                ]
            for call, _ in idle:
                del self._idle[call]
            by_peer: dict[str, list[tuple[float, int]]] = {}
            for call, (peer, since, _) in self._anonymous.items():
                if now - since > ANONYMOUS_GRACE_S:
                    by_peer.setdefault(peer, []).append((since, call))
            excess = [
                (peer, call)
                for peer, held in by_peer.items()
                for _, call in sorted(held)[: len(held) - ANONYMOUS_STREAMS_PER_PEER]
            ]
            anonymous = [(peer, self._anonymous.pop(call)[2]) for peer, call in excess]
        for _, context in idle:
            log.info("cancelling a request stream idle for over %.0fs", self.stream_idle_s)
            context.cancel()
        for peer, context in anonymous:
            log.warning(
                "cancelling a request stream from %s that sent nothing for over %.0fs: that "
                "peer holds more than %d such streams",
                peer,
                ANONYMOUS_GRACE_S,
                ANONYMOUS_STREAMS_PER_PEER,
            )
            context.cancel()

    def _watched(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """``requests``, with the wait for each next message watched for idleness, and the
        wait for the first counted as its peer's anonymous stream."""
        call = next(self._ids)
        with self._lock:
            self._anonymous[call] = (peer_host(context.peer()), self._now(), context)
        try:
            while True:
                with self._lock:
                    self._idle[call] = (self._now(), context)
                try:
                    request = next(requests)
                except StopIteration:
                    return
                finally:
                    with self._lock:
                        self._idle.pop(call, None)
                        self._anonymous.pop(call, None)
                yield request
        finally:
            with self._lock:
                self._idle.pop(call, None)
                self._anonymous.pop(call, None)

    def _sent(self, replies: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        """``replies``, with the wait for the client to take each one watched: a client that
        never reads a reply holds this call (and a thread) until it is cancelled as idle."""
        call = next(self._ids)
        try:
            for reply in replies:
                with self._lock:
                    self._idle[call] = (self._now(), context)
                yield reply  # back here once gRPC has sent it
                with self._lock:
                    self._idle.pop(call, None)
        finally:
            with self._lock:
                self._idle.pop(call, None)

    # -- bytes arriving ------------------------------------------------------------------------

    @property
    def inflight_bytes(self) -> int:
        """The bytes the requests arriving now have reserved (read only)."""
        with self._lock:
            return self._inflight

    @contextlib.contextmanager
    def inflight(self) -> Iterator[Callable[[int], None]]:
        """A ``reserve(n)`` for one call's arriving tensors, all released when the call ends:
        every request arriving at once holds at most ``max_inflight_bytes`` (0: no bound)."""
        held = 0

        def reserve(nbytes: int) -> None:
            nonlocal held
            with self._lock:
                limit = self.max_inflight_bytes
                if limit and self._inflight + nbytes > limit:
                    raise ShardBusyError(
                        f"requests arriving now already declare {self._inflight} bytes; "
                        f"{nbytes} more would pass the limit of {limit} (psserver "
                        "--max-inflight-bytes): retry later"
                    )
                self._inflight += nbytes
                held += nbytes

        try:
            yield reserve
        finally:
            with self._lock:
                self._inflight -= held

    # -- per-worker step streams -----------------------------------------------------------

    @contextlib.contextmanager
    def step_stream(self, worker_id: int) -> Iterator[None]:
        """Holds one of ``worker_id``'s open step streams. At the limit it waits up to
        ``STREAM_GRACE_S`` for one to end: a call the worker has just closed or cancelled
        ends here a moment later (its handler is still returning) while the worker's next
        call is already arriving.

        Raises:
            TooLargeError: the worker still holds ``streams_per_worker`` of them.
        """
        deadline = time.monotonic() + STREAM_GRACE_S
        with self._lock:
            while (held := self._streams.get(worker_id, 0)) >= self.streams_per_worker:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TooLargeError(
                        f"worker {worker_id} already holds {held} open step streams on this "
                        f"shard (limit {self.streams_per_worker}); a worker needs one"
                    )
                self._stream_freed.wait(left)
            self._streams[worker_id] = held + 1
        try:
            yield
        finally:
            with self._lock:
                self._streams[worker_id] -= 1
                if not self._streams[worker_id]:
                    del self._streams[worker_id]
                self._stream_freed.notify_all()

    # -- the interceptor -------------------------------------------------------------------

    def _enter_long(self, context: grpc.ServicerContext, rpc: str) -> None:
        with self._lock:
            if self._long < self.long_limit:
                self._long += 1
                return
        context.set_trailing_metadata(((ERROR_CLASS_KEY, ShardBusyError.__name__),))
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{rpc} refused: the shard already serves {self.long_limit} calls that can wait "
            "or stream (psserver --threads, minus threads kept for status and health); a job "
            "needs --threads of at least 2 x its workers + 8",
        )

    def _exit_long(self) -> None:
        with self._lock:
            self._long -= 1

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` (its path) under these limits (short calls unchanged);
        applied once, when the service is registered."""
        rpc = method.rpartition("/")[2]
        if rpc not in LONG_CALLS:
            return handler
        streams = rpc in REQUEST_STREAMS

        def requests(request: Any, context: grpc.ServicerContext) -> Any:
            return self._watched(iter(request), context) if streams else request

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                self._enter_long(context, rpc)
                try:
                    return behavior(requests(request, context), context)
                finally:
                    self._exit_long()

            return run

        def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self._enter_long(context, rpc)
                try:
                    yield from self._sent(behavior(requests(request, context), context), context)
                finally:
                    self._exit_long()

            return run

        return rewrapped(
            handler,
            lambda kind, behaviour: (streaming if kind.endswith("stream") else unary)(behaviour),
        )


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.3:5123" -> "ipv4:10.0.0.3", "ipv6:[::1]:5"
    -> "ipv6:[::1]"): one machine's connections count together, whatever their ports."""
    kind, sep, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and sep:
        return f"{kind}:{rest.rpartition(':')[0] or rest}"
    return peer
