"""The ring's transport: RingChunk messages encoded by hand, the RingPeer server and stub.

A data chunk is almost all tensor bytes. Building it through protobuf objects copies those
bytes several times (a ``bytes`` slice, the nested message, the serialization: ~4.5 ms per
MiB here, most of an all-reduce's time); the functions below write and read the very same
wire format (``ring.proto``) with one copy out and none in: a received array views the
received message. Aborts are rare and small, so they stay protobuf objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pscore.checks import DTYPES, check_dtype
from pswire.channel import OPTIONS
from pswire.errors import (
    InvalidRequestError,
    PSError,
    TooLargeError,
    UnavailableError,
    error_for_status,
)
from pswire.proto import ring_pb2
from pswire.read import parse_chunk, parse_message
from pswire.rpc_errors import rpc_errors
from pswire.security import ServerSecurity, TokenInterceptor
from pswire.stubs import as_bytes
from pswire.write import encode_chunk_messages, len_field, varint_field
from psworker.ring.peer import Failure, Mailbox, Tag

SERVICE_NAME = ring_pb2.DESCRIPTOR.services_by_name["RingPeer"].full_name
# A failure seen first-hand (a refused or dropped connection, a malformed chunk) outweighs any
# verdict reached only by waiting, however far it travelled.
CERTAIN = 1 << 16
# Dtypes the codec cannot name travel as raw bytes and are viewed back; only bfloat16 bits need it.
_VIEW_DTYPES = frozenset({"uint16"})
_TENSOR_NAME = "ring"
# RingChunk field numbers (ring.proto).
_OP, _SENDER, _STEP, _SEGMENT, _INDEX, _TENSOR, _ABORT, _VIEW_DTYPE = range(1, 9)


def _describe_default(rank: int) -> str:
    return f"rank {rank}"


# -- the messages --------------------------------------------------------------------------


def encode_data(op: int, sender: int, tag: Tag, array: np.ndarray) -> bytes:
    """A serialized RingChunk carrying ``array`` (1-D, contiguous) in one copy of its bytes.

    The header fields follow the tensor on the wire; protobuf reads fields in any order.

    Raises:
        InvalidRequestError: the array's dtype is neither a wire dtype nor viewable as bytes.
    """
    view = ""
    if array.dtype.name not in DTYPES:
        view, array = array.dtype.name, array.view(np.uint8)
    header = b"".join(
        (
            varint_field(_OP, op),
            varint_field(_SENDER, sender),
            varint_field(_STEP, tag.step),
            varint_field(_SEGMENT, tag.segment),
            varint_field(_INDEX, tag.chunk),
            len_field(_VIEW_DTYPE, view.encode()) if view else b"",
        )
    )
    messages = encode_chunk_messages(
        _TENSOR_NAME, array, _TENSOR, chunk_bytes=max(1, array.nbytes), trailer=header
    )
    return next(messages)


def encode_abort(op: int, sender: int, abort: ring_pb2.RingAbort) -> bytes:
    """A serialized RingChunk telling the right neighbour this rank gave up."""
    return ring_pb2.RingChunk(op=op, sender=sender, abort=abort).SerializeToString()


class Received:
    """A parsed RingChunk: its key, and either its array (viewing the message) or an abort."""

    __slots__ = ("abort", "array", "index", "op", "segment", "sender", "step")

    def __init__(self) -> None:
        self.op = self.sender = self.step = self.segment = self.index = 0
        self.array: np.ndarray | None = None
        self.abort: ring_pb2.RingAbort | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        """What the receiving algorithm asks the mailbox for: (op, step, segment, chunk)."""
        return (self.op, self.step, self.segment, self.index)


def parse_sender(data: bytes) -> int | None:
    """The sender field of a serialized RingChunk, or None when the bytes are unreadable.

    Used to name the peer whose stream broke or sent garbage; never raises.
    """
    try:
        for field, _wire, value in parse_message(data):
            if field == _SENDER and isinstance(value, int):
                return value
    except ValueError:
        return None
    return 0


def parse(data: bytes) -> Received:
    """Reads a serialized RingChunk; a tensor becomes a read-only array viewing ``data``.

    Raises:
        InvalidRequestError: the bytes are not a RingChunk, or its tensor is not a whole 1-D
            array of a wire dtype (optionally viewed as an accepted dtype).
    """
    got = Received()
    ints: dict[int, int] = {}
    tensor: memoryview | None = None
    view_dtype = ""
    try:
        for field, _wire, value in parse_message(data):
            if isinstance(value, int):
                ints[field] = value
            elif field == _TENSOR:
                tensor, got.abort = value, None  # a oneof keeps the member set last
            elif field == _ABORT:
                tensor, got.abort = None, ring_pb2.RingAbort.FromString(bytes(value))
            elif field == _VIEW_DTYPE:
                view_dtype = bytes(value).decode("utf-8")
    except ValueError as exc:  # protobuf's DecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequestError(f"unreadable ring chunk: {exc}") from None
    got.op, got.sender = ints.get(_OP, 0), ints.get(_SENDER, 0)
    got.step, got.segment, got.index = (ints.get(f, 0) for f in (_STEP, _SEGMENT, _INDEX))
    if tensor is not None:
        got.array = _tensor_array(tensor, view_dtype)
    return got


def _tensor_array(tensor: memoryview, view_dtype: str) -> np.ndarray:
    """The 1-D array a TensorChunk holds, viewed as ``view_dtype`` if set.

    Raises:
        InvalidRequestError: not a whole 1-D tensor of a wire dtype, or a bad view.
    """
    try:
        chunk = parse_chunk(tensor)
    except ValueError as exc:
        raise InvalidRequestError(f"unreadable tensor in ring chunk: {exc}") from None
    dtype = check_dtype(chunk.dtype, _TENSOR_NAME)
    nbytes = len(chunk.data)
    if chunk.offset or chunk.total_bytes != nbytes or chunk.shape != [nbytes // dtype.itemsize]:
        raise InvalidRequestError(
            f"ring chunk tensor must be one whole 1-D array: shape {chunk.shape}, dtype "
            f"{chunk.dtype}, {nbytes} bytes at offset {chunk.offset} of {chunk.total_bytes}"
        )
    if nbytes % dtype.itemsize:
        raise InvalidRequestError(f"ring chunk of {nbytes} bytes is not whole {chunk.dtype}s")
    array = np.frombuffer(chunk.data, dtype=dtype)
    if not view_dtype:
        return array
    if view_dtype not in _VIEW_DTYPES or array.dtype != np.uint8:
        raise InvalidRequestError(
            f"ring chunk views {array.dtype} data as {view_dtype!r}; only uint8 data viewed as "
            f"{sorted(_VIEW_DTYPES)} is accepted"
        )
    view = np.dtype(view_dtype).newbyteorder("<")
    if array.size % view.itemsize:
        raise InvalidRequestError(f"ring chunk of {array.size} bytes cannot be viewed as {view}")
    return array.view(view)


# -- the stub and the server -----------------------------------------------------------------


class RingPeerStub:
    """The RingPeer client: ``Send`` streams pre-encoded RingChunk bytes (or protobuf ones)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Send = channel.stream_unary(
            f"/{SERVICE_NAME}/Send",
            request_serializer=as_bytes,
            response_deserializer=ring_pb2.SendAck.FromString,
        )


# The most bytes a rank holds of chunks it has not read yet: well above a collective's share.
DEFAULT_MAX_BUFFERED_BYTES = 1 << 30


class RingServer:
    """A worker's RingPeer server: files the chunks its left neighbour streams into a mailbox.

    Start it before the ``Ring`` when the port is chosen by the OS (bind port 0), so its
    address can be shared with the other workers; the ``Ring`` then takes it over.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        threads: int = 8,
        security: ServerSecurity | None = None,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    ) -> None:
        """Binds ``host:port`` (port 0 picks a free one) and starts serving. ``security``: TLS
        (mutual with a CA) and the token, as a shard's; None: plaintext, no token.

        Raises:
            RuntimeError: the address could not be bound.
            ValueError: a TLS file cannot be read.
        """
        security = security or ServerSecurity()
        credentials = security.credentials() if security.tls else None
        self.mailbox = Mailbox()
        self.max_buffered_bytes = max_buffered_bytes
        # The collective this rank is in (or will start next): chunks of it and the one after
        # are filed, any other is refused, so a peer cannot make the mailbox grow unbounded.
        self.current_op = 0
        self.rank: int | None = None
        self.world_size = 0
        self.describe: Callable[[int], str] = _describe_default
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ring-peer"),
            # SO_REUSEPORT off: a second rank or job on a taken port must fail, not take half
            # of this rank's connections (as psserver's shards refuse).
            options=[*OPTIONS, ("grpc.so_reuseport", 0)],
            interceptors=[TokenInterceptor(security.token)] if security.token else [],
        )
        _add_servicer(_RingPeerServicer(self), self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        try:
            if credentials is not None:
                port = self._server.add_secure_port(bind, credentials)
            else:
                port = self._server.add_insecure_port(bind)
        except RuntimeError:  # grpcio raises where older versions returned 0
            port = 0
        if port == 0:
            self._server.stop(0)
            raise RuntimeError(
                f"ring server could not bind {bind}: is the port in use (another job, or a "
                "rank left over from an earlier run) or the host not this machine's?"
            )
        self._server.start()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        self.address = f"{bind.rsplit(':', 1)[0]}:{port}"

    def attach(self, rank: int, world_size: int, describe: Callable[[int], str]) -> None:
        """Tells the server whose it is, so it can check senders and name them in errors."""
        self.rank, self.world_size, self.describe = rank, world_size, describe

    def stop(self, grace: float = 0.5) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 1.0)


def _add_servicer(servicer: _RingPeerServicer, server: grpc.Server) -> None:
    """Registers ``Send`` taking the raw request bytes (parsed by the servicer)."""
    handlers = {
        "Send": grpc.stream_unary_rpc_method_handler(
            servicer.Send,
            request_deserializer=None,  # the servicer parses, so a bad chunk is its error
            response_serializer=ring_pb2.SendAck.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _RingPeerServicer:
    """Decodes each chunk and files it; any trouble fails the mailbox so no wait lingers."""

    def __init__(self, owner: RingServer) -> None:
        self._owner = owner

    @rpc_errors
    def Send(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        owner = self._owner
        received = 0
        last: Received | None = None
        raw: bytes | None = None
        try:
            for raw in request_iterator:
                received += 1
                last = parse(raw)
                self._take(last)
        except grpc.RpcError:
            # The stream broke without the sender closing it: its process died or dropped us.
            if last is not None:
                me = owner.describe(owner.rank) if owner.rank is not None else "this rank"
                detail = (
                    f"{owner.describe(last.sender)} disconnected from {me} during collective "
                    f"{last.op}"
                )
                owner.mailbox.fail(Failure(UnavailableError(detail), CERTAIN, last.sender, detail))
        except PSError as exc:
            origin = parse_sender(raw) if raw is not None else None
            sender = owner.describe(origin) if origin is not None else "a peer"
            detail = f"{sender} sent a malformed ring chunk: {exc}"
            error = InvalidRequestError(detail)
            owner.mailbox.fail(Failure(error, CERTAIN, -1 if origin is None else origin, detail))
            raise
        return ring_pb2.SendAck(received=received)

    def _take(self, chunk: Received) -> None:
        owner = self._owner
        if owner.rank is not None and owner.world_size > 1:
            left = (owner.rank - 1) % owner.world_size
            if chunk.sender != left:
                raise InvalidRequestError(
                    f"rank {chunk.sender} sent to {owner.describe(owner.rank)}, whose left "
                    f"neighbour is {owner.describe(left)}; do all workers use the same list of "
                    "addresses?"
                )
        if chunk.abort is not None:
            self._take_abort(chunk.abort)
            return
        if chunk.array is None:
            raise InvalidRequestError(f"ring chunk of collective {chunk.op} carries no tensor")
        if not owner.current_op <= chunk.op <= owner.current_op + 1:
            raise InvalidRequestError(
                f"{owner.describe(chunk.sender)} sent a chunk of collective {chunk.op}, but this "
                f"rank takes only collectives {owner.current_op} and {owner.current_op + 1}"
            )
        if owner.mailbox.nbytes + chunk.array.nbytes > owner.max_buffered_bytes:
            raise TooLargeError(
                f"{owner.describe(chunk.sender)} sent more than {owner.max_buffered_bytes} bytes "
                "that this rank has not read yet"
            )
        owner.mailbox.put(chunk.key, chunk.array)

    def _take_abort(self, abort: ring_pb2.RingAbort) -> None:
        owner = self._owner
        if abort.origin == owner.rank:
            return  # our own verdict came all the way round the ring
        weight = CERTAIN if abort.certain else abort.hops + 1
        error = error_for_status(abort.status, f"the ring failed elsewhere: {abort.message}")
        owner.mailbox.fail(Failure(error, weight, abort.origin, abort.message))
