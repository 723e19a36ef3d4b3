"""The Flight implementation of the shard link's transport (psworker/transport.py).

A thin adapter over ``FlightLink`` (psworker/flight_link.py, the shard's data port): the same
calls, with every ``PSError`` it raises wrapped as a ``TransportFailure`` (a
``grpc.RpcError`` with the error's status), so ``ShardLink`` retries an unreachable or
restarted shard's data port exactly as it retries its control port.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from pscore.optspec import StepOptions
from pswire import flightwire as fw
from pswire.errors import PSError, WaitTimeoutError
from pswire.proto import ps_pb2
from pswire.security import ClientSecurity
from psworker.flight_link import FlightLink, FlightStream
from psworker.transport import Pieces, Reply, TransportFailure


@contextmanager
def _failures(link: FlightLink, op: str, stream: str = "") -> Iterator[None]:
    """Any PSError of ``link``'s ``op`` as a TransportFailure whose details are the shard's
    message alone (``ShardLink`` names the call and the shard itself); a step whose reply
    never came (the watchdog's) as the WaitTimeoutError the grpcio step stream raises, named
    after ``stream``."""
    try:
        yield
    except PSError as exc:
        message, prefix = str(exc), link.where(op) + ": "
        bare = message.removeprefix(prefix)
        if stream and isinstance(exc, WaitTimeoutError) and bare.startswith("no reply within"):
            raise WaitTimeoutError(f"{stream}: {bare}") from None
        raise TransportFailure(exc, bare) from None


class FlightTransport:
    """Tensors on the shard's Flight data port at ``address`` (host:data port)."""

    name = "flight"

    def __init__(
        self,
        index: int,
        address: str,
        worker_id: int,
        timeout: float,
        security: ClientSecurity,
        session: str,
        where: str = "",
    ) -> None:
        self.address = address
        self.where = where  # how the link names the step stream in errors
        fw.tune_malloc()  # once per process: Flight's message buffers reused, not refaulted
        self.link = FlightLink(index, address, worker_id, timeout, security, session=session)

    def small_steps(self) -> FlightTransport:
        """The same data port for small steps: one message each way, the step stream's own
        request and reply as metadata (``FlightLink.send_step(small=True)``), sharing this
        transport's connection and its one step exchange (closing it closes that)."""
        small = copy.copy(self)
        small.name = "flight-step"
        small.small = True
        return small

    small = False  # steps in one message each way (``small_steps``)

    @property
    def open_call(self) -> object | None:
        return self.link._open

    def push(
        self, step: int, pieces: Pieces, incarnation: str, options: StepOptions | None
    ) -> ps_pb2.PushResponse:
        with _failures(self.link, "push"):
            return self.link.push(step, pieces, incarnation, options)

    def pull(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None
    ) -> tuple[dict[str, np.ndarray], bool]:
        with _failures(self.link, "pull"):
            return self.link.pull_step(request, into)

    def send_step(
        self,
        step: int,
        pieces: Pieces,
        into: Mapping[str, np.ndarray] | None,
        incarnation: str,
        options: StepOptions | None,
        rows: Sequence[ps_pb2.RowQuery],
    ) -> None:
        with _failures(self.link, "push_pull", self.where):
            self.link.send_step(step, pieces, into, incarnation, options, rows, self.small)

    def receive_step(self) -> Reply:
        with _failures(self.link, "push_pull", self.where):
            return self.link.receive_step()

    def when_ended(self, fn: Callable[[], None]) -> None:
        self.link.when_ended(fn)

    def begin_stream(
        self,
        step: int,
        entries: Sequence[ps_pb2.TensorChunk],
        into: Mapping[str, np.ndarray] | None,
        incarnation: str,
        options: StepOptions | None,
        placed: Callable[[str], None] | None = None,
    ) -> StreamedStep:
        """A step streamed as backward produces its tensors (``FlightLink.begin_stream``)."""
        with _failures(self.link, "push_pull", self.where):
            stream = self.link.begin_stream(step, entries, into, incarnation, options, placed)
        return StreamedStep(self.link, stream, self.where)

    def close(self) -> None:
        self.link.close()


class StreamedStep:
    """``FlightStream`` with its failures as ``TransportFailure``, as the other calls."""

    def __init__(self, link: FlightLink, stream: FlightStream, where: str) -> None:
        self._link = link
        self._stream = stream
        self._where = where

    @property
    def deadline(self) -> float:
        """When the exchange's deadline passes (``time.monotonic()``)."""
        return self._stream.deadline

    def write(self, raws: Sequence[np.ndarray]) -> None:
        with _failures(self._link, "push_pull", self._where):
            self._stream.write(raws)

    def read_reply(self) -> None:
        """Lets the reply land in the parameters (``FlightStream.read_reply``): backward is
        over."""
        self._stream.read_reply()

    def end(self) -> Reply:
        with _failures(self._link, "push_pull", self._where):
            return self._stream.end()

    def cancel(self) -> None:
        self._stream.cancel()

    def close(self) -> None:
        self._stream.close()
