"""A worker's long-lived PushPullStream call to one shard, and the watchdog bounding each step."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from pswire.errors import UnavailableError, WaitTimeoutError
from pswire.proto import ps_pb2
from pswire.stubs import ParameterServerStub

# How often the watchdog looks for late replies: a step's deadline holds to within this.
WATCH_TICK_S = 0.05
# The watchdog thread ends after this long with nothing to watch (the next step starts one).
WATCH_IDLE_S = 5.0
# The longest step deadline a request carries (timeout_ms is a uint32): about 49 days.
MAX_STEP_S = (2**32 - 1) / 1000
# A call idle this long is closed and a new one opened for the next step: shards cancel request
# streams idle for their --stream-idle-timeout (120 s by default), and a step must not race that.
IDLE_REOPEN_S = 60.0


def step_timeout_ms(timeout: float) -> int:
    """A step's own deadline as its request carries it."""
    return max(1, round(min(timeout, MAX_STEP_S) * 1000))


class StepStream:
    """Small steps as messages on one open ``PushPullStream`` call to a shard.

    A message each way on an open stream costs well under a new unary call (bench/NOTES.md,
    entry 14), and a small model's step is little else. The call stays open across steps.
    Each step has its own deadline: the shard waits no longer than the request's
    ``timeout_ms``, and a watchdog cancels the call if the reply is late anyway (the step then
    raises ``WaitTimeoutError``). Any error ends the call; the next step opens a new one. One
    step at a time.
    """

    def __init__(self, stub: ParameterServerStub, where: str) -> None:
        self._stub = stub
        self._where = where
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[ps_pb2.PushPullRequest | bytes | None] | None = None
        self._call: Any = None
        self._expired = False
        self._steps = 0  # steps sent: which one the watchdog means
        self._last = 0.0  # when the open call last answered
        # (the call, what to run when it ends): see ``when_ended``.
        self._hook: tuple[Any, Callable[[], None]] | None = None
        self._hook_lock = threading.Lock()

    def step(self, request: ps_pb2.PushPullRequest | bytes, timeout: float) -> Any:
        """Sends one step's request (a protobuf object, whose ``timeout_ms`` is set here, or
        bytes from ``pswire.write.request`` carrying ``step_timeout_ms(timeout)``); returns
        its reply (``pswire.read.parse_reply``'s).

        Raises:
            grpc.RpcError: the call failed (it is closed: the next step opens a new one).
            WaitTimeoutError: no reply within ``timeout`` seconds.
            UnavailableError: the shard ended the call without an answer.
        """
        self.send(request, timeout)
        return self.receive(request, timeout)

    def send(self, request: ps_pb2.PushPullRequest | bytes, timeout: float) -> None:
        """``step``'s first half: sends the request. The stream is this step's until
        ``receive`` (which must follow) returns or raises.

        Raises:
            grpc.RpcError: the call could not be opened.
        """
        if not isinstance(request, bytes):
            request.timeout_ms = step_timeout_ms(timeout)
        self._lock.acquire()
        try:
            if self._call is not None and time.monotonic() - self._last > IDLE_REOPEN_S:
                self._end()
            self._put(request, timeout)
        except BaseException:
            self._lock.release()
            raise

    def receive(self, request: ps_pb2.PushPullRequest | bytes, timeout: float) -> Any:
        """``step``'s second half: the reply to the request ``send`` sent.

        Raises:
            as ``step``.
        """
        try:
            try:
                return self._reply(timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    raise
                # The shard cancelled the call as idle just as this step went out: the step is
                # sent again on a new call (a push it had taken is acknowledged as a retry).
                self._put(request, timeout)
                return self._reply(timeout)
        finally:
            self._lock.release()

    def when_ended(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` (on gRPC's thread, or here) if the call carrying the step just sent
        ends before ``receive`` reads its reply: an error ends the call (a restarted shard's
        ABORTED, UNAVAILABLE, the watchdog's cancel), so the caller can recover this shard
        while it waits for another. At most once; ``receive`` cancels it."""
        with self._hook_lock:
            call = self._call
            if call is not None and hasattr(call, "add_done_callback"):
                self._hook = (call, fn)
            else:
                call = None
        if call is None:
            fn()  # no open call (the send failed): nothing to wait for
        elif call.done():  # ended before the hook was set: its callback found none
            self._ended(call)

    def _ended(self, call: Any) -> None:
        """The call ``call`` ended: runs the hook set for it, if any."""
        with self._hook_lock:
            hook = self._hook
            if hook is None or hook[0] is not call:
                return
            self._hook = None
        hook[1]()

    def _put(self, request: ps_pb2.PushPullRequest | bytes, timeout: float) -> None:
        if self._call is None:
            self._open()
        assert self._requests is not None
        self._expired = False
        self._steps += 1
        self._requests.put(request)
        _WATCHDOG.watch(self, time.monotonic() + timeout, self._steps)

    def _reply(self, timeout: float) -> Any:
        with self._hook_lock:
            self._hook = None  # the reply is read here: nobody else needs to know
        try:
            reply = next(self._call)
            self._last = time.monotonic()
            return reply
        except grpc.RpcError:
            self._end()
            if self._expired:
                raise WaitTimeoutError(f"{self._where}: no reply within {timeout:.1f}s") from None
            raise
        except StopIteration:
            self._end()
            raise UnavailableError(f"{self._where}: the shard ended the step stream") from None
        finally:
            _WATCHDOG.unwatch(self)

    def close(self) -> None:
        """Ends the call (the shard sees the stream end and finishes it)."""
        with self._lock:
            self._end()

    def expire(self, step: int) -> None:
        """Called by the watchdog: the reply to ``step`` is late; cancel the call."""
        if step != self._steps:
            return  # that step was answered after all, and another has begun
        self._expired = True
        call = self._call
        if call is not None:
            call.cancel()

    def _open(self) -> None:
        requests: queue.SimpleQueue[ps_pb2.PushPullRequest | bytes | None] = queue.SimpleQueue()

        def messages() -> Iterator[ps_pb2.PushPullRequest | bytes]:
            # Consumed by grpc's sending thread; None ends the stream.
            while (request := requests.get()) is not None:
                yield request

        self._requests = requests
        # No call deadline: the call outlives any one step, and each step has its own.
        call = self._stub.PushPullStream(messages())
        if hasattr(call, "add_done_callback"):
            call.add_done_callback(self._ended)  # one per call: see ``when_ended``
        self._call = call

    def _end(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
        self._requests = None
        self._call = None


class _Watchdog:
    """One thread per process cancelling the step streams whose reply is overdue."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[StepStream, tuple[float, int]] = {}
        self._thread: threading.Thread | None = None

    def watch(self, stream: StepStream, deadline: float, step: int) -> None:
        with self._cond:
            self._due[stream] = (deadline, step)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ps-step-watchdog", daemon=True
                )
                self._thread.start()

    def unwatch(self, stream: StepStream) -> None:
        with self._cond:
            self._due.pop(stream, None)

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._cond:
                self._cond.wait(WATCH_TICK_S)
                now = time.monotonic()
                late = [(s, step) for s, (due, step) in self._due.items() if now >= due]
                for stream, _ in late:
                    del self._due[stream]
                if self._due or late:
                    idle_since = now
                elif now - idle_since > WATCH_IDLE_S:
                    self._thread = None
                    return
            for stream, step in late:
                stream.expire(step)


_WATCHDOG = _Watchdog()
