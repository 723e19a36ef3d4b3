"""One shard's data port as a worker sees it: push, pull and push_pull over Arrow Flight.

The tensor-carrying calls of ``ShardLink`` with the same arguments and results, on the shard's
Flight port (pswire/flightwire.py has the framing): gradients go out as record batches over
the caller's arrays (no copy), and weights are decoded straight into ``into``'s arrays. Small
steps share one ``DoExchange`` kept open across steps; each step carries its own deadline,
which the shard honours and a watchdog enforces here (the call is cancelled when a reply is
late). Any error ends the exchange; the next step opens another. Errors are the ``PSError``
the shard raised (same class, same status); retries, re-registration and replay stay with the
``ShardLink`` above (psworker/transport_flight.py adapts this to its transport interface).
A step goes in two halves (``send_step``, ``receive_step``), so a worker sends every shard its
step before it waits for any.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
from google.protobuf.message import DecodeError

from pscore.optspec import StepOptions
from pscore.tables import RowSparse
from pswire import flightwire as fw
from pswire import read, write
from pswire.codec import ChunkAssembler
from pswire.errors import InvalidRequestError, PSError, UnavailableError, WaitTimeoutError
from pswire.proto import ps_pb2
from pswire.security import TOKEN_HEADER, TOKEN_SCHEME, ClientSecurity
from pswire.write import push_header
from psworker.stepstream import step_timeout_ms

_FAILURES = (flight.FlightError, pa.ArrowException, OSError)
# A streamed step's reply is read on a thread bounded by the exchange's deadline; past it by
# this much, the wait for that thread gives up.
_READ_SLACK_S = 30.0
# A streamed step's reply is read from the start (beside the upload, while backward runs) once
# the last stream on the link still had more than this share of its bytes to write when
# backward ended: the link, not the CPU, holds the step back. Measured on the emulated 1 Gbit/s
# links 65-80% (reading early: 1.17-1.27x samples/s), over loopback and 10 Gbit/s under 8%
# (reading early: 0.9-0.97x, a CPU-bound machine; bench/NOTES.md 42).
_EARLY_BEHIND = 0.25


class FlightLink:
    """A worker's Flight connection to one shard's data port. One call at a time."""

    def __init__(
        self,
        index: int,
        address: str,
        worker_id: int,
        timeout: float,
        security: ClientSecurity | None = None,
        piece_bytes: int = fw.PIECE_BYTES,
        session: str = "",
    ) -> None:
        self.index = index
        self.address = address
        self.worker_id = worker_id
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        self.session = session
        security = security or ClientSecurity()
        kwargs: dict[str, Any] = {}
        scheme = "grpc+tcp"
        if security.tls:
            scheme = "grpc+tls"
            if security.ca is not None:
                kwargs["tls_root_certs"] = _read(security.ca)
            if security.cert is not None and security.key is not None:
                kwargs["cert_chain"] = _read(security.cert)
                kwargs["private_key"] = _read(security.key)
        self._client = flight.FlightClient(f"{scheme}://{address}", **kwargs)
        self._headers: list[tuple[bytes, bytes]] = []
        if security.token:
            self._headers.append((TOKEN_HEADER.encode(), (TOKEN_SCHEME + security.token).encode()))
        self._lock = threading.Lock()
        self._open: tuple[Any, Any] | None = None  # the step exchange kept open
        self._open_command = fw.PUSH_PULL  # its command: fw.PUSH_PULL or fw.STEP
        self._watchdog = _Watchdog()
        # The step sent and not yet answered: (where its reply goes, the deadline fired,
        # whether it went as a small step).
        self._pending: tuple[Mapping[str, np.ndarray] | None, threading.Event, bool] | None = None
        self._early: Future[Any] | None = None  # its reply, read on a thread (``when_ended``)
        self._reading: ThreadPoolExecutor | None = None
        self._streaming: FlightStream | None = None  # a step streamed from backward, if open
        # Where a streamed step's reply lands while backward still runs (``StagedInto``):
        # name -> array, kept across steps. A stream takes it while it reads its reply, so a
        # stream begun while an older one's read still winds down gets arrays of its own.
        self.staging: dict[str, np.ndarray] = {}
        # The share of the last streamed step's bytes not yet written when backward ended
        # (its last tensor, held until then, aside).
        self.behind = 0.0

    def where(self, op: str) -> str:
        return f"{op} on shard {self.index} ({self.address}, Flight)"

    def push_pull(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None = None,
        incarnation: str = "",
        options: StepOptions | None = None,
        rows: Sequence[ps_pb2.RowQuery] = (),
    ) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
        """This shard's pieces of one step (with ``options``; and ``rows`` of tables read
        after it), then the weights for the step after it, on the exchange kept open (decoded
        into ``into``'s arrays where given).

        Raises:
            PSError: the shard refused the step (its class and status), the shard was
                unreachable (UnavailableError), or no reply came within ``timeout``
                (WaitTimeoutError).
        """
        self.send_step(step, pieces, into, incarnation, options, rows)
        return self.receive_step()

    def send_step(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None = None,
        incarnation: str = "",
        options: StepOptions | None = None,
        rows: Sequence[ps_pb2.RowQuery] = (),
        small: bool = False,
    ) -> None:
        """``push_pull``'s first half: sends the step. The exchange is this step's until
        ``receive_step`` (which must follow unless this raised) returns or raises. ``small``:
        in one message each way, the step stream's own request and reply as metadata
        (``fw.STEP``), on an exchange of its own kept open; else as record batches.

        Raises:
            PSError: as ``push_pull`` (the exchange is then closed).
        """
        where = self.where("push_pull")
        request = self._request(step, pieces, incarnation, options)
        command = fw.STEP if small else fw.PUSH_PULL
        self._lock.acquire()
        expired = threading.Event()
        self._pending = (into, expired, small)
        try:
            if self._open is not None and self._open_command != command:
                self._close_open()  # one exchange at a time: a worker's streams are capped
            if self._open is None:
                self._open = self._exchange(command, None, where)
                self._open_command = command
            writer, reader = self._open

            def expire() -> None:
                expired.set()
                with contextlib.suppress(*_FAILURES):
                    reader.cancel()

            self._watchdog.arm(time.monotonic() + self.timeout, expire)
            if small:
                writer.write_metadata(
                    write.request(request.header, pieces, rows, request.timeout_ms)
                )
            else:
                request.rows.extend(rows)
                self._send(writer, request, pieces)
        except BaseException as exc:
            self._pending = None
            self._lock.release()
            raise self._failure(exc, expired, where) from None

    def when_ended(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` if the step just sent fails before ``receive_step`` is called: its
        reply is read on a thread of its own meanwhile (so a restarted shard is recovered
        while the caller waits for another shard's reply). At most once."""
        if self._pending is None:
            fn()  # no step in flight (its send failed): nothing to wait for
            return
        if self._early is None:
            if self._reading is None:
                self._reading = ThreadPoolExecutor(1, thread_name_prefix="ps-flight-reply")
            self._early = self._reading.submit(self._read_pending)
        self._early.add_done_callback(lambda f: fn() if f.exception() is not None else None)

    def receive_step(self) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
        """``push_pull``'s second half: the reply to the step ``send_step`` sent.

        Raises:
            PSError: as ``push_pull``.
        """
        try:
            early, self._early = self._early, None
            if early is not None:
                return early.result()  # type: ignore[no-any-return]
            return self._read_pending()
        finally:
            self._pending = None
            self._lock.release()

    def _read_pending(self) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
        where = self.where("push_pull")
        assert self._pending is not None
        into, expired, small = self._pending
        try:
            if self._open is None:
                raise UnavailableError(f"{where}: the exchange closed before the reply")
            if small:
                return _read_small_reply(self._open[1], into, where)
            reply, arrays = _read_reply(self._open[1], into, where)
        except BaseException as exc:
            raise self._failure(exc, expired, where) from None
        finally:
            self._watchdog.disarm()
        return reply.push, arrays

    def _failure(self, exc: BaseException, expired: threading.Event, where: str) -> BaseException:
        """The error a failed step raises; the exchange is closed (the next step opens one)."""
        self._watchdog.disarm()
        self._close_open()
        if expired.is_set():
            return WaitTimeoutError(f"{where}: no reply within {self.timeout:.1f}s")
        return _error(exc, where)

    def begin_stream(
        self,
        step: int,
        entries: Sequence[ps_pb2.TensorChunk],
        into: Mapping[str, np.ndarray] | None = None,
        incarnation: str = "",
        options: StepOptions | None = None,
        placed: Callable[[str], None] | None = None,
    ) -> FlightStream:
        """A step whose tensors follow as backward produces them: its header, with the
        manifest ``entries`` (every tensor it will carry, in the order they will come), is
        written now on an exchange of its own (``fw.STREAMED``: the shard reads it as it
        arrives, not on its turn in a sync round), whose gRPC deadline is ``timeout`` from now on
        both ends (a worker that stalls mid-step, or is paused, frees the shard when it
        passes; the shard applies nothing before the last byte). The exchange kept open for
        other steps is closed first: a worker holds at most two step streams on a shard.
        ``placed(key)``: told as each tensor of the reply is decoded into ``into``.

        Its reply may stream back while the push is still being written (``fw.PIPELINED``:
        a step's weights, predicted as their gradients arrive). It is read, on a thread, from
        ``FlightStream.read_reply`` on (the caller's backward is over: the parameters in
        ``into`` may change); or, where the link was behind backward in the last streamed
        step (``_EARLY_BEHIND``), from the start, so the download runs beside the upload,
        what arrives before ``read_reply`` waiting in the link's staging arrays
        (``StagedInto``). The pieces of a predicted reply are ``placed`` only once its
        trailer confirmed them.

        Raises:
            PSError: the exchange could not be opened, or the shard refused at once.
        """
        where = self.where("push_pull")
        request = self._request(step, {}, incarnation, options)
        request.chunks.extend(entries)
        with self._lock:
            self._close_open()
            # Read before the call starts, so the stream's own deadline never trails its gRPC
            # one: a step() that comes after the shard dropped the stream always finds it
            # expired (and sends the step whole), never a write past the gRPC deadline.
            deadline = time.monotonic() + self.timeout
            writer, reader = self._exchange(fw.PIPELINED, self.timeout, where)
        out = fw.StepWriter(writer, request.SerializeToString(), self.piece_bytes)
        staged = None
        if into is not None and self.behind > _EARLY_BEHIND:
            staged = StagedInto(into, self.staging, placed)
            self.staging = {}
        # What can leave before backward ends: all but the last tensor, held until step().
        held = next((e.total_bytes for e in reversed(entries) if e.total_bytes), 0)
        total = sum(e.total_bytes for e in entries)
        stream = FlightStream(
            self, writer, reader, out, into, where, deadline, placed, total, held, staged
        )
        self._streaming = stream
        try:
            out.header()
        except BaseException as exc:
            stream.close()
            raise _error(exc, where) from None
        if staged is not None:
            stream.start_reading()
        return stream

    def push(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        incarnation: str = "",
        options: StepOptions | None = None,
    ) -> ps_pb2.PushResponse:
        """A push of this shard's pieces of one step, on a call of its own.

        Raises:
            PSError: as ``push_pull``.
        """
        where = self.where("push")
        request = self._request(step, pieces, incarnation, options)

        def run(writer: Any, reader: Any) -> ps_pb2.PushResponse:
            self._send(writer, request, pieces)
            reply, _ = _read_reply(reader, None, where)
            return reply.push

        return self._one_call(fw.PUSH, run, where)

    def pull(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """A pull on a call of its own (decoded into ``into``'s arrays where given).

        Raises:
            PSError: as ``push_pull``.
        """
        return self.pull_step(request, into)[0]

    def pull_step(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None = None
    ) -> tuple[dict[str, np.ndarray], bool]:
        """``pull``, and whether the shard says the step before it was skipped (sync).

        Raises:
            PSError: as ``push_pull``.
        """
        where = self.where("pull")
        request.timeout_ms = step_timeout_ms(self.timeout)

        def run(writer: Any, reader: Any) -> tuple[dict[str, np.ndarray], bool]:
            writer.write_metadata(request.SerializeToString())
            reply, arrays = _read_reply(reader, into, where)
            return arrays, reply.push.skipped

        return self._one_call(fw.PULL, run, where)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Ends the open exchange, a streamed step's (cancelled: the shard applies nothing),
        and the connection."""
        streaming = self._streaming
        if streaming is not None:
            streaming.cancel()
        with self._lock:
            self._close_open()
            self._watchdog.stop()
            if self._reading is not None:
                self._reading.shutdown(wait=False)
            with contextlib.suppress(*_FAILURES):
                self._client.close()

    # -- internals ------------------------------------------------------------------------------

    def _request(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        incarnation: str,
        options: StepOptions | None = None,
    ) -> ps_pb2.PushPullRequest:
        header = push_header(self.worker_id, step, incarnation, options, self.session)
        return ps_pb2.PushPullRequest(header=header, timeout_ms=step_timeout_ms(self.timeout))

    def _send(
        self,
        writer: Any,
        request: ps_pb2.PushPullRequest,
        pieces: Mapping[str, np.ndarray | RowSparse],
    ) -> None:
        entries, raws = fw.encode_tensors(pieces)
        del request.chunks[:]
        request.chunks.extend(entries)
        fw.write_step(writer, request.SerializeToString(), list(raws.values()), self.piece_bytes)

    def _exchange(self, command: bytes, timeout: float | None, where: str) -> tuple[Any, Any]:
        options = flight.FlightCallOptions(timeout=timeout, headers=self._headers)
        try:
            writer, reader = self._client.do_exchange(
                flight.FlightDescriptor.for_command(command), options=options
            )
            writer.begin(fw.SCHEMA)
        except BaseException as exc:
            raise _error(exc, where) from None
        return writer, reader

    def _one_call(self, command: bytes, run: Callable[[Any, Any], Any], where: str) -> Any:
        with self._lock:
            writer, reader = self._exchange(command, self.timeout, where)
            try:
                result = run(writer, reader)
                writer.done_writing()
                with contextlib.suppress(StopIteration):
                    reader.read_chunk()  # the shard ends the call once our side is done
                return result
            except BaseException as exc:
                raise _error(exc, where) from None
            finally:
                with contextlib.suppress(*_FAILURES):
                    writer.close()

    def _close_open(self) -> None:
        if self._open is None:
            return
        writer, _ = self._open
        self._open = None
        with contextlib.suppress(*_FAILURES):
            writer.done_writing()
        with contextlib.suppress(*_FAILURES):
            writer.close()


class StagedInto(Mapping[str, np.ndarray]):
    """A streamed step's ``into`` while its reply is read during backward, which may still
    read the parameters: a tensor begun before ``release`` is decoded into a staging array,
    and copied into its ``into`` array once it is complete and backward is over; one begun
    after goes straight there, unless its ``into`` array is not C-ordered (a conv weight in
    ``channels_last``), which no reply is decoded into: staged and copied too. ``placed``
    hears of a tensor only once it is in ``into``.

    ``get``, ``completed`` and ``placed`` come from the thread reading the reply (the
    assembler asks ``get`` at each tensor's start), ``release`` from the training thread
    (it copies nothing: backward's end is not held up), ``copy_staged`` from the thread
    writing the step, once it has written the last tensor; whichever of those two threads
    comes first copies a tensor, one tensor at a time under the lock.
    """

    def __init__(
        self,
        into: Mapping[str, np.ndarray],
        staging: dict[str, np.ndarray],
        placed: Callable[[str], None] | None,
    ) -> None:
        self._into = into
        self.staging = staging  # the link's, given back once the reply is read
        self._on_placed = placed
        self._lock = threading.Lock()
        self._released = False
        self._begun: set[str] = set()  # staged, not complete yet
        self._done: dict[str, None] = {}  # staged and complete, not copied: in arrival order
        self._deferred: set[str] = set()  # placed before it was copied

    def __getitem__(self, name: str) -> np.ndarray:
        return self._into[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._into)

    def __len__(self) -> int:
        return len(self._into)

    def get(self, name: str, default: Any = None) -> Any:
        """Where tensor ``name`` of the reply is decoded: its ``into`` array once released
        (where C-ordered), else a staging array like it."""
        target = self._into.get(name)
        if target is None:
            return default
        with self._lock:
            if not target.flags.writeable or (self._released and target.flags.c_contiguous):
                return target
            staged = self.staging.get(name)
            if staged is None or staged.shape != target.shape or staged.dtype != target.dtype:
                staged = self.staging[name] = np.empty_like(target, order="C")
            self._begun.add(name)
            return staged

    def completed(self, name: str, array: np.ndarray) -> None:
        """Tensor ``name`` of the reply is complete (``array``): copied into ``into`` now if
        it was staged and backward is over, else later."""
        with self._lock:
            if name not in self._begun:
                return
            self._begun.discard(name)
            if not np.may_share_memory(array, self.staging[name]):
                return  # the assembler decoded it elsewhere (another wire dtype): not staged
            self._done[name] = None
        if self._released:
            self._copy(name)

    def placed(self, name: str) -> None:
        """Tensor ``name`` is in place: ``placed`` is told once it is in ``into`` (copied
        now if backward is over, else when it is)."""
        with self._lock:
            if name in self._begun or (name in self._done and not self._released):
                self._deferred.add(name)
                return
        self._copy(name)
        if self._on_placed is not None:
            self._on_placed(name)

    def release(self) -> None:
        """Backward is over: the rest of the reply is decoded straight into ``into``; what
        was staged is copied there by the reply's threads (``copy_staged``, ``placed``)."""
        with self._lock:
            self._released = True

    def copy_staged(self) -> None:
        """Copies every staged tensor into ``into`` (after ``release``), the last to arrive
        first (backward's order: the forward's first layers), and tells ``placed`` of those
        it was told of before."""
        while True:
            with self._lock:
                if not self._released or not self._done:
                    return
                name = next(reversed(self._done))
            self._copy(name)

    def _copy(self, name: str) -> None:
        with self._lock:
            if name not in self._done:
                return  # copied already, or never staged
            del self._done[name]
            np.copyto(self._into[name], self.staging[name])
            told = name in self._deferred
            self._deferred.discard(name)
        if told and self._on_placed is not None:
            self._on_placed(name)


class FlightStream:
    """A streamed step's exchange (``FlightLink.begin_stream``): the tensors written in
    manifest order as they come, then the reply (read from the start where ``staged``). One
    thread writes and ends it; ``cancel`` may come from any thread (it unblocks a write the
    shard does not take)."""

    def __init__(
        self,
        link: FlightLink,
        writer: Any,
        reader: Any,
        out: fw.StepWriter,
        into: Mapping[str, np.ndarray] | None,
        where: str,
        deadline: float,
        placed: Callable[[str], None] | None = None,
        total: int = 0,
        held: int = 0,
        staged: StagedInto | None = None,
    ) -> None:
        self._link = link
        self._placed = placed
        self._writer = writer
        self._reader = reader
        self._out = out
        self._into = into
        self._staged = staged
        self._where = where
        self._total = total  # the bytes of the step's tensors
        self._held = held  # of which the last tensor's, held until step()
        self._written = 0
        self._backward_over = False  # ``read_reply`` came
        self.deadline = deadline  # at or before the exchange's gRPC deadline
        self._ended = False  # the reply was read: nothing to cancel
        self._closed = False
        self._reading: Future[tuple[ps_pb2.PushPullResponse, dict[str, np.ndarray]]] | None = None
        self._read_lock = threading.Lock()

    def start_reading(self) -> Future[tuple[ps_pb2.PushPullResponse, dict[str, np.ndarray]]]:
        """Starts reading the reply, on a thread (once: later calls return the same read);
        until ``read_reply``, its tensors wait in the staging arrays (``staged``)."""
        with self._read_lock:
            if self._reading is None:
                self._reading = Future()
                threading.Thread(
                    target=_fill,
                    args=(self._reading, self._read),
                    name="ps-flight-reply",
                    daemon=True,
                ).start()
            return self._reading

    def read_reply(self) -> Future[tuple[ps_pb2.PushPullResponse, dict[str, np.ndarray]]]:
        """Lets the reply land in ``into``, reading it if not yet begun; the first call notes
        how far behind backward the writes were (``FlightLink.behind``). Called when the
        parameters may change: backward is over."""
        with self._read_lock:
            first, self._backward_over = not self._backward_over, True
        if first and self._total:
            left = self._total - self._held - self._written
            self._link.behind = max(0, left) / self._total
        if self._staged is not None:
            self._staged.release()
        return self.start_reading()

    def _read(self) -> tuple[ps_pb2.PushPullResponse, dict[str, np.ndarray]]:
        staged = self._staged
        if staged is None:
            return _read_streamed_reply(self._reader, self._into, self._where, self._placed)
        try:
            return _read_streamed_reply(
                self._reader, staged, self._where, staged.placed, completed=staged.completed
            )
        finally:
            self._link.staging = staged.staging  # nothing writes into them any more

    def write(self, raws: Sequence[np.ndarray]) -> None:
        """The next tensors of the manifest (uint8 arrays, ``encode_tensor``'s).

        Raises:
            PSError: the exchange failed (the shard's status where it refused the step).
        """
        try:
            self._out.write(raws)
        except BaseException as exc:
            raise _error(exc, self._where) from None
        self._written += sum(r.nbytes for r in raws)

    def end(self) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
        """Ends the step (every manifest tensor written) and reads its reply, decoded into
        ``into``; the shard has ended the call when this returns.

        Raises:
            PSError: as ``FlightLink.push_pull``.
        """
        try:
            self._out.close()
            self._writer.done_writing()
            reading = self.read_reply()
            if self._staged is not None:
                self._staged.copy_staged()  # while the shard applies the step
            # The read is bounded by the exchange's gRPC deadline; the slack only guards
            # against a thread that never returns.
            left = self.deadline - time.monotonic() + _READ_SLACK_S
            try:
                reply, arrays = reading.result(timeout=max(0.0, left))
            except FutureTimeout:
                raise WaitTimeoutError(
                    f"{self._where}: no reply within {self._link.timeout:.1f}s"
                ) from None
            self._ended = True
            # The shard ends the call once our side is done: wait for it, so the step stream
            # it held is free before this worker opens the next.
            with contextlib.suppress(StopIteration, *_FAILURES):
                self._reader.read_chunk()
            return reply.push, arrays
        except BaseException as exc:
            raise _error(exc, self._where) from None
        finally:
            self.close()

    def cancel(self) -> None:
        """Cancels the exchange: the shard reads a cut stream and applies nothing of it."""
        with contextlib.suppress(*_FAILURES):
            self._reader.cancel()

    def close(self) -> None:
        """Releases the exchange (cancelled first unless ``end`` finished it)."""
        if self._closed:
            return
        self._closed = True
        if not self._ended:
            self.cancel()
        with contextlib.suppress(*_FAILURES):
            self._writer.close()
        if self._link._streaming is self:
            self._link._streaming = None


def _fill(future: Future[Any], read: Callable[[], Any]) -> None:
    try:
        future.set_result(read())
    except BaseException as exc:  # the caller of ``result`` raises it
        future.set_exception(exc)


def _read_reply(
    reader: Any,
    into: Mapping[str, np.ndarray] | None,
    where: str,
    placed: Callable[[str], None] | None = None,
) -> tuple[ps_pb2.PushPullResponse, dict[str, np.ndarray]]:
    """A step's reply: its header, then its tensors (into ``into`` where given; ``placed``
    told of each as it lands there).

    Raises:
        UnavailableError: the shard ended the exchange without a reply.
        InvalidRequestError: a malformed reply.
    """
    reply, first = _read_header(reader, where)
    assembler = ChunkAssembler(into=into)
    arrays = fw.read_step(reader, first.data, reply.chunks, assembler, where, placed)
    return reply, arrays


def _read_header(reader: Any, where: str) -> tuple[Any, Any]:
    """(a reply's header, a PushPullResponse; the message it rode on, whose data are the
    reply's first bytes).

    Raises:
        UnavailableError: the shard ended the exchange without a reply.
    """
    try:
        first = reader.read_chunk()
    except StopIteration:
        raise UnavailableError(f"{where}: the shard ended the exchange without a reply") from None
    reply = fw.parse(ps_pb2.PushPullResponse, first.app_metadata, where)
    return reply, first


def _read_streamed_reply(
    reader: Any,
    into: Mapping[str, np.ndarray] | None,
    where: str,
    placed: Callable[[str], None] | None = None,
    completed: Callable[[str, np.ndarray], None] | None = None,
) -> tuple[ps_pb2.PushPullResponse, dict[str, np.ndarray]]:
    """A streamed step's reply (``fw.PIPELINED``): as ``_read_reply``, or, where its header
    carries no ``push``, predicted before its round closed: a trailer after the tensors
    carries the push's result and the clock and confirms them; only then are they
    ``placed``.

    Raises:
        UnavailableError: the shard ended the exchange before the reply or its trailer.
        InvalidRequestError: a malformed reply.
    """
    reply, first = _read_header(reader, where)
    assembler = ChunkAssembler(into=into)
    if reply.HasField("push"):
        arrays = fw.read_step(reader, first.data, reply.chunks, assembler, where, placed, completed)
        return reply, arrays
    arrays = fw.read_step(reader, first.data, reply.chunks, assembler, where, None, completed)
    try:
        last = reader.read_chunk()
    except StopIteration:
        raise UnavailableError(
            f"{where}: the shard ended the exchange before the trailer"
        ) from None
    if last.data is not None:
        raise InvalidRequestError(f"{where}: bytes after the reply's last tensor")
    trailer = fw.parse(ps_pb2.PushPullResponse, last.app_metadata, where)
    if not trailer.HasField("push"):
        raise InvalidRequestError(f"{where}: a predicted reply's trailer carries no push")
    if placed is not None:
        for chunk in reply.chunks:
            if assembler.placed(chunk.name):
                placed(chunk.name)
    return trailer, arrays


def _read_small_reply(
    reader: Any, into: Mapping[str, np.ndarray] | None, where: str
) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
    """A small step's reply: one message whose metadata is the step stream's reply (the
    push's result and every tensor inline), decoded into ``into`` where given.

    Raises:
        UnavailableError: the shard ended the exchange without a reply.
        InvalidRequestError: a malformed reply.
    """
    try:
        first = reader.read_chunk()
    except StopIteration:
        raise UnavailableError(f"{where}: the shard ended the exchange without a reply") from None
    raw = first.app_metadata
    if raw is None or first.data is not None:
        raise InvalidRequestError(f"{where}: a small step's reply is one message of metadata")
    try:
        reply = read.parse_reply(raw.to_pybytes())
    except (ValueError, DecodeError) as exc:
        raise InvalidRequestError(f"{where}: undecodable reply: {exc}") from None
    assembler = ChunkAssembler(into=into)
    chunks: Any = reply.chunks  # read.WireChunk: read as a TensorChunk (duck-typed)
    for chunk in chunks:
        assembler.add(chunk)
    return reply.push, assembler.finish()


def _error(exc: BaseException, where: str) -> BaseException:
    """A PSError for any failure of a Flight call; other exceptions (a bug, Ctrl-C) as they are."""
    if isinstance(exc, PSError):
        return exc
    if isinstance(exc, _FAILURES):
        return fw.from_flight_error(exc, where)
    return exc


def _read(path: Path) -> bytes:
    """A PEM file's bytes.

    Raises:
        ValueError: it cannot be read.
    """
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from exc


class _Watchdog:
    """A thread that runs an action when a step's deadline passes before it is disarmed.

    Arming wakes the thread only when it must wait less than it already does: steps in a row
    (each deadline later than the last) cost no thread wake-up each.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: tuple[float, Callable[[], None]] | None = None
        self._thread: threading.Thread | None = None
        self._until: float | None = None  # when the thread's current wait ends; None: idle
        self._stopped = False

    def arm(self, deadline: float, action: Callable[[], None]) -> None:
        with self._cond:
            self._due = (deadline, action)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ps-flight-watch")
                self._thread.daemon = True
                self._thread.start()
            if self._until is None or deadline < self._until:
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._due = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._due = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                if self._due is None:
                    self._until = None
                    self._cond.wait()
                    continue
                deadline, action = self._due
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._until = deadline
                    self._cond.wait(wait)
                    continue
                self._due = None
            action()
