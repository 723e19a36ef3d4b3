"""Scheduled fault injection for clients: drop, lose the reply of, duplicate or delay a call."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable

import grpc


class InjectedUnavailable(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What a dropped connection looks like to the caller: UNAVAILABLE."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self._what = what

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._what

    def initial_metadata(self):  # pragma: no cover - grpc.Call interface
        return None

    def trailing_metadata(self):  # pragma: no cover
        return None

    def is_active(self) -> bool:  # pragma: no cover
        return False

    def time_remaining(self):  # pragma: no cover
        return None

    def cancel(self) -> bool:  # pragma: no cover
        return False

    def add_callback(self, callback) -> bool:  # pragma: no cover
        return False

    # A unary call's interceptor returns an RpcError as the call's outcome (a grpc.Future).
    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):  # pragma: no cover
        return self

    def done(self) -> bool:  # pragma: no cover
        return True


class FaultPlan(
    grpc.UnaryUnaryClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Applies ``action`` to the calls of ``rpc`` whose 1-based count is in ``nth``.

    Actions: ``drop`` (never sent, caller sees UNAVAILABLE), ``lose_reply`` (sent and handled
    by the server, but the caller sees UNAVAILABLE), ``duplicate`` (sent twice), ``delay``
    (sent after ``delay_s``). Thread-safe; ``fired`` counts the faults applied.
    """

    def __init__(self, rpc: str, nth: Iterable[int], action: str, delay_s: float = 0.0) -> None:
        if action not in ("drop", "lose_reply", "duplicate", "delay"):
            raise ValueError(f"unknown action {action!r}")
        self.rpc = rpc
        self.nth = set(nth)
        self.action = action
        self.delay_s = delay_s
        self.calls = 0
        self.fired = 0
        self._lock = threading.Lock()

    def _should_fire(self, method: str) -> bool:
        if not method.endswith("/" + self.rpc):
            return False
        with self._lock:
            self.calls += 1
            fire = self.calls in self.nth
            self.fired += fire
            return fire

    def _run(
        self,
        continuation,
        client_call_details,
        request,
        streaming_request: bool,
        streaming_response: bool = False,
    ):
        if not self._should_fire(client_call_details.method):
            return continuation(client_call_details, request)
        what = f"injected {self.action} of {self.rpc} call {self.calls}"
        if self.action == "drop":
            raise InjectedUnavailable(what)
        if streaming_request:
            request = list(request)  # a stream can be sent only once: keep it to send again
        again = iter(request) if streaming_request else request
        if self.action == "delay":
            time.sleep(self.delay_s)
            return continuation(client_call_details, again)
        response = continuation(client_call_details, again)
        if self.action == "lose_reply":
            # Let the server finish the call (a streamed reply is read to its end), then lose it.
            if streaming_response:
                list(response)
            else:
                response.result()
            raise InjectedUnavailable(what)
        # duplicate (unary replies only): the same call again, as a retrying network delivers it
        if streaming_response:
            raise ValueError("duplicate applies to calls with a unary reply")
        response.result()
        return continuation(client_call_details, iter(request) if streaming_request else request)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._run(continuation, client_call_details, request, False)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return self._run(continuation, client_call_details, request_iterator, True)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return self._run(continuation, client_call_details, request, False, True)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        if client_call_details.method.endswith("/PushPullStream"):
            return self._per_message(continuation, client_call_details, request_iterator)
        return self._run(continuation, client_call_details, request_iterator, True, True)

    def _per_message(self, continuation, client_call_details, request_iterator):
        """A long-lived call with one reply per request (PushPullStream): the plan counts and
        hits its messages, not its calls; a hit message's fault reaches the caller as
        UNAVAILABLE, as a broken connection would."""
        if self.rpc != "PushPullStream":
            return continuation(client_call_details, request_iterator)
        actions: queue.SimpleQueue = queue.SimpleQueue()  # each request's fault, in order

        def requests():
            for request in request_iterator:
                action = self.action if self._should_fire(client_call_details.method) else None
                actions.put(action)
                if action == "drop":
                    continue
                if action == "delay":
                    time.sleep(self.delay_s)
                yield request
                if action == "duplicate":
                    yield request

        return _FaultyReplies(continuation(client_call_details, requests()), actions)


class _FaultyReplies:
    """The replies of a PushPullStream call, with the planned faults applied."""

    def __init__(self, call, actions: queue.SimpleQueue) -> None:
        self._call = call
        self._actions = actions

    def __iter__(self):
        return self

    def __next__(self):
        action = self._actions.get(timeout=30)  # put when grpc took the request to send
        if action == "drop":
            raise InjectedUnavailable("injected drop of a PushPullStream message")
        reply = next(self._call)
        if action == "lose_reply":
            raise InjectedUnavailable("injected lose_reply of a PushPullStream message")
        if action == "duplicate":
            reply = next(self._call)  # the shard's answer to the copy: a duplicate push
        return reply

    def cancel(self) -> bool:
        return self._call.cancel()


class FaultyTransport:
    """A shard link's data-port transport (psworker/transport.py) with ``plans`` applied, as
    ``FaultPlan`` applies them to grpcio calls: ``Push`` and ``Pull`` count calls,
    ``PushPullStream`` counts steps (the data port's push_pull exchange, its step exchange's
    small steps, streamed steps). A hit call's fault reaches the link as UNAVAILABLE, as a
    broken connection would."""

    def __init__(self, inner, plans: Iterable[FaultPlan]) -> None:
        self.inner = inner
        self.name = inner.name
        self.address = getattr(inner, "address", "")
        self._plans = list(plans)
        self._step_action: str | None = None

    def _action(self, rpc: str) -> str | None:
        for plan in self._plans:
            if plan.rpc == rpc and plan._should_fire("/" + rpc):
                if plan.action == "delay" and rpc != "PushPullStream":
                    time.sleep(plan.delay_s)
                    return None
                self._delay = plan.delay_s
                return plan.action
        return None

    @staticmethod
    def _unavailable(what: str):
        from pswire.errors import UnavailableError
        from psworker.transport import TransportFailure

        return TransportFailure(UnavailableError(f"injected {what}"))

    def _run(self, rpc: str, call):
        action = self._action(rpc)
        if action == "drop":
            raise self._unavailable(f"drop of {rpc}")
        reply = call()
        if action == "lose_reply":
            raise self._unavailable(f"lose_reply of {rpc}")
        if action == "duplicate":
            reply = call()
        return reply

    def push(self, step, pieces, incarnation, options):
        return self._run("Push", lambda: self.inner.push(step, pieces, incarnation, options))

    def pull(self, request, into):
        return self._run("Pull", lambda: self.inner.pull(request, into))

    def send_step(self, step, pieces, into, incarnation, options, rows):
        action = self._action("PushPullStream")
        if action == "drop":
            raise self._unavailable("drop of a step")
        self._step_action = action
        self._again = (step, pieces, into, incarnation, options, rows)
        self.inner.send_step(step, pieces, into, incarnation, options, rows)

    def receive_step(self):
        action, self._step_action = self._step_action, None
        if action == "delay":  # the reply is late: the step's deadline runs meanwhile
            time.sleep(self._delay)
        reply = self.inner.receive_step()
        if action == "lose_reply":
            raise self._unavailable("lose_reply of a step")
        if action == "duplicate":
            self.inner.send_step(*self._again)
            reply = self.inner.receive_step()
        return reply

    def when_ended(self, fn) -> None:
        self.inner.when_ended(fn)

    def begin_stream(self, step, entries, into, incarnation, options, placed=None):
        """A step streamed from backward (``overlap=True``) counts as a step: ``drop`` fails
        it at its header (nothing written), ``lose_reply`` loses its reply once the shard
        has applied it, ``delay`` holds its end (its deadline runs meanwhile); a stream cannot
        be sent twice, so ``duplicate`` leaves it as it is."""
        action = self._action("PushPullStream")
        if action == "drop":
            raise self._unavailable("drop of a streamed step")
        stream = self.inner.begin_stream(step, entries, into, incarnation, options, placed)
        return _FaultyStream(stream, action, self._delay) if action else stream

    def close(self) -> None:
        self.inner.close()


class _FaultyStream:
    """A streamed step (psworker/transport_flight.py ``StreamedStep``) with its fault."""

    def __init__(self, inner, action: str, delay_s: float) -> None:
        self.inner = inner
        self.action = action
        self.delay_s = delay_s

    @property
    def deadline(self) -> float:
        return self.inner.deadline

    def write(self, raws) -> None:
        self.inner.write(raws)

    def read_reply(self) -> None:
        self.inner.read_reply()

    def end(self):
        if self.action == "delay":
            time.sleep(self.delay_s)
        reply = self.inner.end()
        if self.action == "lose_reply":
            raise FaultyTransport._unavailable("lose_reply of a streamed step")
        return reply

    def cancel(self) -> None:
        self.inner.cancel()

    def close(self) -> None:
        self.inner.close()


def flight_faults(client, plans: Iterable[FaultPlan]) -> None:
    """Applies ``plans`` to the data port of each of ``client``'s links, now (after ``init``:
    the links learn their data ports when they register) and whenever a link dials a new
    one (after a shard's restart)."""
    plans = list(plans)
    if not plans:
        return
    for link in client.links:
        dial = link._dial_data

        def dialled(port: int, link=link, dial=dial) -> None:
            dial(port)
            # Both of the data port's forms: record batches, and small steps in one message.
            if link.flight is not None and not isinstance(link.flight, FaultyTransport):
                link.flight = FaultyTransport(link.flight, plans)
            steps = link.flight_steps
            if steps is not None and not isinstance(steps, FaultyTransport):
                link.flight_steps = FaultyTransport(steps, plans)

        link._dial_data = dialled
        dialled(link.data_port)
