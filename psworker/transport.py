"""The transport seam under a shard link: how a step's, a push's and a pull's tensors travel.

One interface, several implementations (ps-lite's ``Van``): ``GrpcTransport`` (this module:
the grpcio step stream and the streamed Push and Pull of the control port) and
``FlightTransport`` (psworker/transport_flight.py: the shard's Arrow Flight data port).
``ShardLink`` (psworker/link.py) keeps everything else: retries, re-registration, replay after
a restart, incarnations, the job's identity; it picks the transport for each call
(``choose``). A transport raises ``grpc.RpcError`` for every failure, its status code saying
whether the link may recover (UNAVAILABLE, ABORTED), so the link's retry rule is one rule
whatever the transport.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import numpy as np

from pscore.optspec import StepOptions
from pscore.tables import RowSparse
from pswire import write
from pswire.codec import ChunkAssembler
from pswire.errors import ERROR_CLASS_KEY, PSError
from pswire.proto import ps_pb2
from pswire.stubs import ParameterServerStub
from pswire.write import push_header, push_stream
from psworker.stepstream import StepStream, step_timeout_ms

Reply = tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]
Pieces = Mapping[str, np.ndarray | RowSparse]


class TransportFailure(grpc.RpcError):
    """Raised by a transport that does not speak grpcio (Flight) for any failure: the
    ``PSError`` it stands for, read as a failed grpcio call reads (``code()``, ``details()``:
    the shard's message, ``trailing_metadata()``: the error's class), so ``ShardLink``
    retries and reports it exactly as it does a grpcio call's."""

    def __init__(self, error: PSError, details: str | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self._details = str(error) if details is None else details

    def code(self) -> grpc.StatusCode:
        return self.error.code  # type: ignore[no-any-return]

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((ERROR_CLASS_KEY, type(self.error).__name__),)


class Transport(Protocol):
    """What a shard link needs to move tensors to and from one shard.

    Every method raises ``grpc.RpcError`` (a ``TransportFailure`` where the transport is not
    grpcio) when the call fails; ``ShardLink`` maps it to a ``PSError`` or recovers.
    """

    name: str  # "grpc" or "flight": logs and ``psctl status``

    @property
    def open_call(self) -> object | None:
        """The call kept open across steps (None: none open now)."""
        ...

    def push(
        self, step: int, pieces: Pieces, incarnation: str, options: StepOptions | None
    ) -> ps_pb2.PushResponse:
        """One step's pieces, on a call of its own."""
        ...

    def pull(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None
    ) -> tuple[dict[str, np.ndarray], bool]:
        """(the arrays, decoded into ``into``'s where given; whether the shard says the step
        before ``request.step`` was skipped)."""
        ...

    def send_step(
        self,
        step: int,
        pieces: Pieces,
        into: Mapping[str, np.ndarray] | None,
        incarnation: str,
        options: StepOptions | None,
        rows: Sequence[ps_pb2.RowQuery],
    ) -> None:
        """Sends one push_pull step; ``receive_step`` must follow unless this raised."""
        ...

    def receive_step(self) -> Reply:
        """The reply to the step ``send_step`` sent: the push's result and the weights."""
        ...

    def when_ended(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` once if the step just sent fails before ``receive_step`` reads it."""
        ...

    def close(self) -> None:
        """Ends any call kept open."""
        ...


class GrpcTransport:
    """Tensors on the control port's grpcio calls: a step as one message each way on the
    open ``PushPullStream`` (``StepStream``), streamed ``Push`` and ``Pull`` otherwise."""

    name = "grpc"

    def __init__(
        self,
        stub: ParameterServerStub,
        worker_id: int,
        timeout: float,
        chunk_bytes: int,
        session: str,
        where: str,
    ) -> None:
        self.stub = stub
        self.worker_id = worker_id
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.session = session
        self.steps = StepStream(stub, where)
        self._sent: tuple[Any, Mapping[str, np.ndarray] | None] | None = None

    @property
    def open_call(self) -> object | None:
        return self.steps._call

    def push(
        self, step: int, pieces: Pieces, incarnation: str, options: StepOptions | None
    ) -> ps_pb2.PushResponse:
        stream = push_stream(
            self.worker_id, step, pieces, self.chunk_bytes, incarnation, self.session, options
        )
        reply: ps_pb2.PushResponse = self.stub.Push(stream, timeout=self.timeout)
        return reply

    def pull(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None
    ) -> tuple[dict[str, np.ndarray], bool]:
        assembler = ChunkAssembler(into=into)
        skipped = False
        for reply in self.stub.Pull(request, timeout=self.timeout):
            if reply.skipped:  # one last message, without a chunk
                skipped = True
                continue
            assembler.add(reply.chunk)
        return assembler.finish(), skipped

    def send_step(
        self,
        step: int,
        pieces: Pieces,
        into: Mapping[str, np.ndarray] | None,
        incarnation: str,
        options: StepOptions | None,
        rows: Sequence[ps_pb2.RowQuery],
    ) -> None:
        header = push_header(self.worker_id, step, incarnation, options, self.session)
        request = write.request(header, pieces, rows, step_timeout_ms(self.timeout))
        self.steps.send(request, self.timeout)
        self._sent = (request, into)

    def receive_step(self) -> Reply:
        assert self._sent is not None, "receive_step without send_step"
        (request, into), self._sent = self._sent, None
        reply = self.steps.receive(request, self.timeout)
        assembler = ChunkAssembler(into=into)
        for chunk in reply.chunks:
            assembler.add(chunk)
        return reply.push, assembler.finish()

    def when_ended(self, fn: Callable[[], None]) -> None:
        self.steps.when_ended(fn)

    def close(self) -> None:
        self.steps.close()
