"""The ring's transport on Arrow Flight: a RingServer filing the left neighbour's chunks, and
the ``RightLink`` that streams this rank's chunks to its right neighbour.

Each rank keeps one ``DoPut`` stream open to its right neighbour for the ring's whole life. A
message is a record batch of one ``uint8`` column (``pswire.flightwire.SCHEMA``) built over the
sender's array without a copy, with a fixed binary header as its app metadata: kind, collective,
sender, tag and dtype. The receiver files the batch's bytes as a numpy view of the buffer gRPC
received into, so the algorithm adds it straight into its own buffer. Aborts and the flush
marker that ends a collective are metadata-only messages on the same stream (so they arrive in
order after the data); the receiver acknowledges each flush on the stream's metadata channel,
which is how a sender knows its right neighbour holds every chunk it sent.

The data port is the ring's only port: the address ranks exchange (TF_CONFIG's worker list, or
the rendezvous store) is this server's. TLS, mutual TLS and the token come from the same
``ServerSecurity``/``ClientSecurity`` settings as the shards' ports.
"""

from __future__ import annotations

import contextlib
import queue
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from google.protobuf.message import DecodeError

from pswire import flightwire as fw
from pswire.errors import (
    InvalidRequestError,
    PSError,
    TooLargeError,
    UnauthenticatedError,
    UnavailableError,
    WaitTimeoutError,
    error_for_status,
)
from pswire.proto import ring_pb2
from pswire.security import TOKEN_HEADER, TOKEN_SCHEME, ClientSecurity, ServerSecurity
from psworker.ring.peer import Failure, Mailbox, Tag

# A failure seen first-hand (a refused or dropped connection, a malformed chunk) outweighs any
# verdict reached only by waiting, however far it travelled.
CERTAIN = 1 << 16
COMMAND = b"psworker.ring/1"
READY_ACTION = "psworker.ring.ready"
# The most bytes a rank holds of chunks it has not read yet: well above a collective's share.
DEFAULT_MAX_BUFFERED_BYTES = 1 << 30
# How long a chunk of the collective after next waits for this rank to catch up (the Ring sets
# its own timeout).
DEFAULT_WAIT_S = 30.0
# kind, collective, sender, ring step, segment, chunk, dtype code.
HEADER = struct.Struct("<BQIIIIB")
DATA, ABORT, FLUSH = 0, 1, 2
# The dtypes a chunk may carry (little-endian); uint16 is bfloat16's bits, uint8 broadcast bytes.
DTYPES = tuple(np.dtype(d).newbyteorder("<") for d in ("f2", "f4", "f8", "u2", "u1"))
_CODES = {d: i for i, d in enumerate(DTYPES)}
_ACK = struct.Struct("<Q")
_STATUS = object()  # tells the writing thread to read the call's status: the call has ended
_FAILURES = (flight.FlightError, pa.ArrowException, OSError)
# How long a connection attempt waits before the next (the neighbour may not listen yet).
_RETRY_S = 0.05
# How long closing waits for the client's own close (it waits for a blocked write).
_CLOSE_S = 1.0


def _describe_default(rank: int) -> str:
    return f"rank {rank}"


# -- the messages --------------------------------------------------------------------------


_NO_TAG = Tag(0, 0, 0)


def encode_header(kind: int, op: int, sender: int, tag: Tag = _NO_TAG, code: int = 0) -> bytes:
    """A message's app metadata (abort messages append the serialized ``RingAbort``)."""
    return HEADER.pack(kind, op, sender, tag.step, tag.segment, tag.chunk, code)


def dtype_code(dtype: np.dtype) -> int:
    """The header's code for ``dtype``.

    Raises:
        InvalidRequestError: not one of the dtypes a ring chunk carries.
    """
    code = _CODES.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise InvalidRequestError(
            f"a ring chunk carries {[str(d) for d in DTYPES]}, got {np.dtype(dtype)}"
        )
    return code


class Received:
    """A parsed message: its key, and its array (viewing the received buffer), abort or flush."""

    __slots__ = ("abort", "array", "index", "kind", "op", "segment", "sender", "step")

    def __init__(self, kind: int, op: int, sender: int, step: int, segment: int, index: int):
        self.kind, self.op, self.sender = kind, op, sender
        self.step, self.segment, self.index = step, segment, index
        self.array: np.ndarray | None = None
        self.abort: ring_pb2.RingAbort | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        """What the receiving algorithm asks the mailbox for: (op, step, segment, chunk)."""
        return (self.op, self.step, self.segment, self.index)


def parse_sender(metadata: bytes | memoryview | None) -> int | None:
    """The sender a message's header names, or None when the header is unreadable."""
    if metadata is None or len(metadata) < HEADER.size:
        return None
    return int(HEADER.unpack_from(metadata)[2])


def parse(metadata: bytes | memoryview, batch: pa.RecordBatch | None) -> Received:
    """Reads one message; a data chunk's array is a read-only view of the batch's buffer.

    Raises:
        InvalidRequestError: a short or unknown header, a data chunk without whole elements of
            its dtype, or an unreadable abort.
    """
    meta = memoryview(metadata)
    if len(meta) < HEADER.size:
        raise InvalidRequestError(
            f"unreadable ring chunk: {len(meta)} bytes of header, expected {HEADER.size}"
        )
    kind, op, sender, step, segment, index, code = HEADER.unpack_from(meta)
    got = Received(kind, op, sender, step, segment, index)
    if kind == DATA:
        if code >= len(DTYPES):
            raise InvalidRequestError(f"ring chunk from rank {sender} has unknown dtype {code}")
        data = fw.batch_bytes(batch, f"ring chunk from rank {sender}")
        dtype = DTYPES[code]
        if len(data) % dtype.itemsize:
            raise InvalidRequestError(
                f"ring chunk from rank {sender} of {len(data)} bytes is not whole {dtype}s"
            )
        got.array = np.frombuffer(data, dtype=dtype)
    elif kind == ABORT:
        try:
            got.abort = ring_pb2.RingAbort.FromString(bytes(meta[HEADER.size :]))
        except DecodeError as exc:
            raise InvalidRequestError(f"unreadable ring abort from rank {sender}: {exc}") from None
    elif kind != FLUSH:
        raise InvalidRequestError(f"ring message from rank {sender} has unknown kind {kind}")
    return got


# -- the server ----------------------------------------------------------------------------


def _pem(path: Path | None, what: str) -> bytes:
    try:
        return Path(str(path)).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc}") from None


class RingServer:
    """A worker's ring port: files the chunks its left neighbour streams into a mailbox.

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
        (mutual with a CA) and the token, as a shard's; None: plaintext, no token. ``threads``
        is accepted for callers that size a server pool; Flight sizes its own.

        Raises:
            RuntimeError: the address could not be bound.
            ValueError: a TLS file cannot be read.
        """
        del threads
        fw.tune_malloc()  # once per process: the chunks' buffers reused, not refaulted
        security = security or ServerSecurity()
        options: dict[str, Any] = {}
        scheme = "grpc+tcp"
        if security.tls:
            scheme = "grpc+tls"
            cert, key = _pem(security.cert, "TLS certificate"), _pem(security.key, "TLS key")
            options["tls_certificates"] = [flight.CertKeyPair(cert=cert, key=key)]
            if security.mutual:
                options["verify_client"] = True
                options["root_certificates"] = _pem(security.ca, "TLS CA certificate")
        if security.token:
            options["middleware"] = {"token": fw.TokenCheck(security.token, "ring rank", "ring")}
        self.mailbox = Mailbox()
        self.max_buffered_bytes = max_buffered_bytes
        # The collective this rank is in (or will start next): chunks of it and the one after
        # are filed; one further ahead waits (up to ``wait_s``) until this rank catches up,
        # any other is refused, so a peer cannot make the mailbox grow unbounded.
        self._current_op = 0
        self._advanced = threading.Condition()
        self.wait_s = DEFAULT_WAIT_S
        self.rank: int | None = None
        self.world_size = 0
        self.describe: Callable[[int], str] = _describe_default
        self._stopped = False
        host, _, port = bind.rpartition(":")
        try:
            # SO_REUSEPORT stays off (Flight's gRPC server sets it so): a second rank or job on
            # a taken port must fail, not take half of this rank's connections.
            self._service = _RingService(self, f"{scheme}://{bind}", **options)
        except _FAILURES as exc:
            raise RuntimeError(
                f"ring server could not bind {bind}: is the port in use (another job, or a "
                f"rank left over from an earlier run) or the host not this machine's? ({exc})"
            ) from None
        self.port = int(self._service.port)
        self.address = f"{host}:{self.port}"
        del port

    @property
    def current_op(self) -> int:
        return self._current_op

    @current_op.setter
    def current_op(self, op: int) -> None:
        with self._advanced:
            self._current_op = op
            self._advanced.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def describe_self(self) -> str:
        return self.describe(self.rank) if self.rank is not None else f"ring port {self.address}"

    def attach(
        self,
        rank: int,
        world_size: int,
        describe: Callable[[int], str],
        wait_s: float = DEFAULT_WAIT_S,
    ) -> None:
        """Tells the server whose it is, so it can check senders and name them in errors, and
        how long a chunk from a left neighbour that ran ahead may wait for this rank."""
        self.rank, self.world_size, self.describe = rank, world_size, describe
        self.wait_s = wait_s

    def stop(self, grace: float = 0.5) -> None:
        """Stops serving; an open stream from the left neighbour is cut after ``grace`` s."""
        if self._stopped:
            return
        with self._advanced:
            self._stopped = True
            self._advanced.notify_all()
        done = threading.Thread(target=self._service.shutdown, daemon=True)
        done.start()
        done.join(grace + 1.0)

    # -- what the service calls -------------------------------------------------------------

    def take(self, chunk: Received) -> None:
        """Files a data chunk or records an abort.

        Raises:
            InvalidRequestError: not from the left neighbour, or of a collective this rank
                does not take now.
            TooLargeError: more unread bytes than ``max_buffered_bytes``.
        """
        if self.rank is not None and self.world_size > 1:
            left = (self.rank - 1) % self.world_size
            if chunk.sender != left:
                raise InvalidRequestError(
                    f"rank {chunk.sender} sent to {self.describe(self.rank)}, whose left "
                    f"neighbour is {self.describe(left)}; do all workers use the same list of "
                    "addresses?"
                )
        if chunk.abort is not None:
            self._take_abort(chunk.abort)
            return
        if chunk.array is None:
            return
        if chunk.op == self.current_op + 2:
            # A broadcast's root needs nothing from its left, so it may start the collective
            # after next while this rank still finishes one: hold the stream until it starts
            # the next (gRPC's flow control holds the sender meanwhile).
            with self._advanced:
                self._advanced.wait_for(
                    lambda: chunk.op <= self._current_op + 1 or self._stopped, self.wait_s
                )
        if not self.current_op <= chunk.op <= self.current_op + 1:
            raise InvalidRequestError(
                f"{self.describe(chunk.sender)} sent a chunk of collective {chunk.op}, but this "
                f"rank takes only collectives {self.current_op} and {self.current_op + 1}"
            )
        if self.mailbox.nbytes + chunk.array.nbytes > self.max_buffered_bytes:
            raise TooLargeError(
                f"{self.describe(chunk.sender)} sent more than {self.max_buffered_bytes} bytes "
                "that this rank has not read yet"
            )
        self.mailbox.put(chunk.key, chunk.array)

    def _take_abort(self, abort: ring_pb2.RingAbort) -> None:
        if abort.origin == self.rank:
            return  # our own verdict came all the way round the ring
        weight = CERTAIN if abort.certain else abort.hops + 1
        error = error_for_status(abort.status, f"the ring failed elsewhere: {abort.message}")
        self.mailbox.fail(Failure(error, weight, abort.origin, abort.message))

    def broke(self, sender: int | None, op: int, exc: BaseException) -> None:
        """The left neighbour's stream ended without its closing it: it died or dropped us."""
        if self._stopped or sender is None:
            return
        me = self.describe_self()
        detail = f"{self.describe(sender)} disconnected from {me} during collective {op}"
        self.mailbox.fail(Failure(UnavailableError(detail), CERTAIN, sender, detail))

    def closed(self, sender: int | None, op: int) -> None:
        """The left neighbour's stream ended cleanly (its worker closed its client or left;
        a killed process's socket may end so too): a wait for anything it did not send fails
        at once, naming it, rather than timing out."""
        if self._stopped or sender is None:
            return
        me = self.describe_self()
        detail = (
            f"{self.describe(sender)} disconnected from {me} (its stream ended after "
            f"collective {op}: its worker closed its client, left the job, or died)"
        )
        self.mailbox.end(Failure(UnavailableError(detail), CERTAIN, sender, detail))

    def refused(self, sender: int | None, error: PSError) -> None:
        """A malformed or unwanted chunk: fail this rank's waits at once, naming the sender."""
        who = self.describe(sender) if sender is not None else "a peer"
        detail = f"{who} sent a malformed ring chunk: {error}"
        origin = sender if sender is not None else self.rank if self.rank is not None else 0
        failure = Failure(type(error)(detail), CERTAIN, origin, detail)
        self.mailbox.fail(failure)


class _RingService(flight.FlightServerBase):
    """Thin adapter from Flight onto a ``RingServer``: parse each message and file it."""

    def __init__(self, owner: RingServer, location: str, **options: Any) -> None:
        super().__init__(location, **options)
        self._owner = owner

    def do_action(self, context: Any, action: Any) -> list[bytes]:
        if action.type != READY_ACTION:
            raise fw.to_flight_error(
                InvalidRequestError(f"unknown ring action {action.type!r}"), "ring"
            )
        return []

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        owner = self._owner
        sender: int | None = None
        op = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                owner.closed(sender, op)  # a clean end: what it sent stays readable
                return
            except _FAILURES as exc:
                owner.broke(sender, op, exc)
                return
            metadata = chunk.app_metadata
            try:
                got = parse(metadata if metadata is not None else b"", chunk.data)
                if owner.stopped and got.kind == DATA:
                    # Flight's shutdown waits for open calls: end this one, so the sender
                    # learns at its next chunk that this rank is gone. (A flush is still
                    # acknowledged: it only confirms chunks this rank took before it stopped.)
                    raise UnavailableError(f"{owner.describe_self()} has stopped its ring port")
                sender, op = got.sender, got.op
                owner.take(got)
            except PSError as exc:
                if not owner.stopped:
                    owner.refused(parse_sender(metadata), exc)
                raise fw.to_flight_error(exc, "ring") from None
            if got.kind == FLUSH:
                writer.write(pa.py_buffer(_ACK.pack(got.op)))


# -- the client ----------------------------------------------------------------------------


class RightLink:
    """This rank's stream to its right neighbour: messages queue here and a thread writes them.

    ``send`` never blocks the algorithm (the array is kept as a view and written later, as the
    ``Peer`` protocol allows); ``flush`` waits until the neighbour has taken every message of a
    collective. A broken stream calls ``on_failure`` once with the error naming the neighbour.
    """

    def __init__(
        self,
        address: str,
        *,
        sender: int,
        right: str,
        me: str,
        timeout: float,
        security: ClientSecurity | None = None,
        on_failure: Callable[[PSError], None] = lambda error: None,
    ) -> None:
        """Connects (retrying until ``timeout``) and opens the stream.

        Raises:
            UnavailableError: nothing accepted a connection within ``timeout``.
            UnauthenticatedError: the neighbour refused this rank's token or certificate.
        """
        security = security or ClientSecurity()
        self._sender, self._right, self._me = sender, right, me
        self._on_failure = on_failure
        kwargs: dict[str, Any] = {}
        scheme = "grpc+tcp"
        if security.tls:
            scheme = "grpc+tls"
            if security.ca is not None:
                kwargs["tls_root_certs"] = _pem(security.ca, "TLS CA certificate")
            if security.cert is not None and security.key is not None:
                kwargs["cert_chain"] = _pem(security.cert, "TLS certificate")
                kwargs["private_key"] = _pem(security.key, "TLS key")
        headers: list[tuple[bytes, bytes]] = []
        if security.token:
            headers.append((TOKEN_HEADER.encode(), (TOKEN_SCHEME + security.token).encode()))
        self._headers = headers
        self._client = flight.FlightClient(f"{scheme}://{address}", **kwargs)
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._written = 0  # messages written so far: a flush's progress
        self._acked = -1  # the last collective the neighbour acknowledged
        self._error: PSError | None = None
        self._closing = False
        try:
            self._wait_ready(timeout)
            options = flight.FlightCallOptions(headers=headers)
            descriptor = flight.FlightDescriptor.for_command(COMMAND)
            self._writer, self._acks = self._client.do_put(descriptor, fw.SCHEMA, options)
        except BaseException:
            self._client.close()
            raise
        self._threads = [
            threading.Thread(target=self._write_loop, name="ring-send", daemon=True),
            threading.Thread(target=self._ack_loop, name="ring-acks", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        action = flight.Action(READY_ACTION, b"")
        while True:
            remaining = deadline - time.monotonic()
            options = flight.FlightCallOptions(
                timeout=max(0.05, min(1.0, remaining)), headers=self._headers
            )
            try:
                list(self._client.do_action(action, options))
                return
            except flight.FlightUnauthenticatedError as exc:
                raise fw.from_flight_error(exc, f"{self._me}: {self._right} refused") from None
            except _FAILURES as exc:
                if time.monotonic() + _RETRY_S >= deadline:
                    raise UnavailableError(
                        f"{self._me}: {self._right} accepted no connection within "
                        f"{timeout:g} s; is that worker running? ({str(exc).splitlines()[0]})"
                    ) from None
            time.sleep(_RETRY_S)

    # -- what the ring calls ----------------------------------------------------------------

    @property
    def error(self) -> PSError | None:
        with self._cond:
            return self._error

    def send(self, op: int, tag: Tag, array: np.ndarray) -> None:
        """Queues ``array`` (kept as a view: not to be changed until the neighbour has it)."""
        self._queue.put(
            (encode_header(DATA, op, self._sender, tag, dtype_code(array.dtype)), array)
        )

    def send_abort(self, op: int, abort: ring_pb2.RingAbort) -> None:
        """Queues a message telling the right neighbour this rank gave up, and why."""
        self._queue.put((encode_header(ABORT, op, self._sender) + abort.SerializeToString(), None))

    def flush(self, op: int, timeout: float) -> None:
        """Waits until the right neighbour acknowledged every message of collective ``op``.

        Raises:
            WaitTimeoutError: the neighbour took nothing for ``timeout`` seconds.
            PSError: the stream failed (the neighbour is gone, or refused a chunk).
        """
        self._queue.put((encode_header(FLUSH, op, self._sender), None))
        with self._cond:
            progress = (self._written, self._acked)
            while self._acked < op:
                if self._error is not None:
                    raise self._error
                if not self._cond.wait(timeout):
                    now = (self._written, self._acked)
                    if now == progress:
                        raise WaitTimeoutError(
                            f"{self._me}: {self._right} took no data for {timeout:g} s "
                            f"(collective {op}); is that worker stuck?"
                        )
                    progress = now
            if self._error is not None:
                raise self._error

    def close(self, grace: float) -> None:
        """Lets queued messages (an abort) go out for up to ``grace`` s, then ends the stream."""
        self._closing = True
        self._queue.put(None)
        self._threads[0].join(max(0.0, grace))
        # A neighbour that stopped reading (SIGSTOP) leaves a write blocked, and closing the
        # client then waits for it: close in the background and give up after a moment.
        closer = threading.Thread(target=self._close_client, name="ring-close", daemon=True)
        closer.start()
        closer.join(_CLOSE_S)

    def _close_client(self) -> None:
        with contextlib.suppress(*_FAILURES):
            self._client.close()

    # -- the threads ------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # the stream is gone; drain so close() finishes
            if item is _STATUS:
                try:
                    self._writer.close()
                except _FAILURES as exc:
                    self._fail(exc)
                else:
                    self._fail(UnavailableError(f"{self._right} closed the connection"))
                continue
            header, array = item
            try:
                if array is None:
                    self._writer.write_metadata(header)
                else:
                    self._writer.write_with_metadata(fw.as_batch(array), header)
            except _FAILURES as exc:
                self._fail(exc, final=True)
                continue
            with self._cond:
                self._written += 1
        try:
            if self._error is None:
                self._writer.done_writing()
            self._writer.close()
        except _FAILURES:
            pass

    def _ack_loop(self) -> None:
        while True:
            try:
                ack = self._acks.read()
            except _FAILURES as exc:
                self._fail(exc)
                return
            if ack is None:
                # The neighbour ended the call (its process died, it stopped, or it refused a
                # message) while this rank still streams to it: the writing thread reads why.
                self._queue.put(_STATUS)
                return
            with self._cond:
                self._acked = max(self._acked, _ACK.unpack(ack.to_pybytes())[0])
                self._cond.notify_all()

    def _fail(self, exc: BaseException, final: bool = False) -> None:
        if self._closing:
            return
        # The neighbour's own verdict (a refused chunk) comes with the call's status, which
        # closing reads (only the writing thread touches the writer).
        reason: BaseException = exc
        if final and not getattr(exc, "extra_info", None):
            try:
                self._writer.close()
            except _FAILURES as status:
                reason = status
        error = fw.from_flight_error(reason, f"{self._me} could not send to {self._right}")
        if not isinstance(error, InvalidRequestError | TooLargeError | UnauthenticatedError):
            error = UnavailableError(str(error))
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            self._cond.notify_all()
        self._on_failure(error)
