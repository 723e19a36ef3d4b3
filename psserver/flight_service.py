"""A shard's data port on Arrow Flight: decode a step's record batches, call ``Shard``, encode.

The control service (register, heartbeat, init, status, checkpoint, health) stays on grpcio
(psserver/server.py); this serves the tensor bytes of push, pull and push_pull as Flight
``DoExchange`` calls framed as pswire/flightwire.py describes. Like the grpcio servicer it is
thin: each step is one call into ``Shard``, whose rules (consistency, exactly-once per
``(worker_id, step)``, incarnation, validation before any change) are the same whatever the
transport. TLS, mutual TLS and the token are Flight's own options and a server middleware.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import pyarrow.flight as flight
from google.protobuf.message import DecodeError

from psserver.admission import DEFAULT_THREADS, Admission
from psserver.metrics import ShardMetrics
from psserver.pipeline import Preview
from psserver.servicer import DEADLINE_MARGIN_S, push_response, row_query, step_reply
from psserver.shard import Shard
from pswire import flightwire as fw
from pswire import read
from pswire.codec import ChunkAssembler, assembled_grads, header_options
from pswire.errors import (
    CallCancelledError,
    InvalidRequestError,
    PSError,
    TooLargeError,
    UnavailableError,
)
from pswire.proto import ps_pb2
from pswire.security import ServerSecurity

log = logging.getLogger(__name__)
DEFAULT_PIECE_BYTES = fw.PIECE_BYTES
# Each data command's step, in metrics, as the grpcio call doing the same. A streamed step is
# timed apart: its time runs from its header, sent at backward's first gradient, so it
# includes the backward it overlapped.
RPC_OF = {
    fw.PUSH_PULL: "PushPull",
    fw.STREAMED: "PushPullStreamed",
    fw.PIPELINED: "PushPullStreamed",
    fw.PUSH: "Push",
    fw.PULL: "Pull",
    fw.STEP: "PushPull",
}
# A small step's request may pass the shard's byte limit on its tensors by this much: its
# header, each tensor's framing, the row ids (``--max-request-bytes`` counts the tensors).
STEP_FRAMING_BYTES = 1 << 20


class _Exchange(contextlib.ExitStack):
    """One DoExchange call's hold on the shard's limits: the worker whose step stream it is."""

    worker: int | None = None

    def hold_stream(self, admission: Admission, worker_id: int) -> None:
        """At the exchange's first step, holds one of ``worker_id``'s step streams."""
        if self.worker is None:
            self.enter_context(admission.step_stream(worker_id))
            self.worker = worker_id


class FlightShardService(flight.FlightServerBase):
    """Thin adapter from Flight DoExchange onto one ``Shard``: per step, decode the request
    and its batches, make one call into the shard, encode the reply's batches."""

    def __init__(
        self,
        shard: Shard,
        location: str,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        admission: Admission | None = None,
        metrics: ShardMetrics | None = None,
        **options: Any,
    ) -> None:
        super().__init__(location, **options)
        self.metrics = metrics  # each step timed and counted as the grpcio call of its kind
        self.shard = shard
        self.piece_bytes = piece_bytes
        # The same limits as the control port's (bytes arriving at once, step streams per
        # worker): one Admission for both front ends.
        self.admission = admission or Admission(threads=DEFAULT_THREADS)
        self.stopping = threading.Event()  # set by ``RunningFlightService.stop``

    def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        op = descriptor.command
        try:
            step = self._ops().get(op)
            if step is None:
                raise InvalidRequestError(
                    f"unknown data command {op!r}; expected one of {list(fw.COMMANDS)}"
                )
            writer.begin(fw.SCHEMA)
            with _Exchange() as held:
                while True:
                    try:
                        first = reader.read_chunk()
                    except StopIteration:
                        return  # the worker closed the exchange: done
                    if context.is_cancelled():
                        raise CallCancelledError(f"{op.decode()}: the worker cancelled the call")
                    if self.stopping.is_set():  # an exchange kept open outlives the stop
                        raise UnavailableError(f"{op.decode()}: the shard is stopping")
                    self._timed(op, step, context, first, reader, writer, held)
        except Exception as exc:
            raise fw.to_flight_error(exc, f"DoExchange {op!r}") from None

    def _timed(self, op: bytes, step: Any, *args: Any) -> None:
        """Runs one step, timed and counted under its grpcio call's name (``RPC_OF``)."""
        if self.metrics is None:
            step(*args)
            return
        start, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            step(*args)
        except PSError as exc:
            code = exc.code
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            raise
        finally:
            self.metrics.observe_rpc(RPC_OF[op], code, time.perf_counter() - start)

    def _ops(self) -> dict[bytes, Any]:
        return {
            fw.PUSH_PULL: self._push_pull,
            # Read as it arrives: see _read_push.
            fw.STREAMED: functools.partial(self._push_pull, turn=False),
            fw.PIPELINED: self._pipelined,
            fw.PUSH: self._push,
            fw.PULL: self._pull,
            fw.STEP: self._step,
        }

    def _step(self, context: Any, first: Any, reader: Any, writer: Any, held: _Exchange) -> None:
        """A small step (``fw.STEP``): the step stream's request in the message's metadata,
        answered as the grpcio step stream answers it (``servicer.step_reply``), its reply's
        bytes in the metadata of one message back. Its bytes count towards
        ``--max-inflight-bytes`` while they are read, as a push's do (``_read_push``): a push
        waiting for its sync round holds none, or the round's last push could be refused for
        the bytes of those waiting for it."""
        if first.data is not None:
            raise InvalidRequestError("step: a small step carries no record batch")
        raw = first.app_metadata
        if raw is None or not raw.size:
            raise InvalidRequestError("step: expected a PushPullRequest, got none")
        limit = self.shard.limits.max_request_bytes
        if raw.size > limit + STEP_FRAMING_BYTES:
            raise TooLargeError(
                f"step: a request of {raw.size} bytes, over the limit of {limit} bytes of "
                f"tensors and {STEP_FRAMING_BYTES} of framing"
            )
        with self.admission.inflight() as reserve:
            reserve(raw.size)
            try:
                request = read.parse_request(raw.to_pybytes())
            except (ValueError, DecodeError) as exc:
                raise InvalidRequestError(f"step: undecodable PushPullRequest: {exc}") from None
        h = request.header
        held.hold_stream(self.admission, h.worker_id)
        timeout = fw.request_timeout(request.timeout_ms, DEADLINE_MARGIN_S)
        reply = step_reply(self.shard, request, timeout, context.is_cancelled)
        writer.write_metadata(reply)

    def _read_push(
        self, context: Any, first: Any, reader: Any, where: str, turn: bool = True
    ) -> tuple[Any, dict[str, Any], float | None]:
        """(the request, its gradients, what is left of the step's wait), every tensor checked
        against the manifest, the shard's byte limit and the bytes arriving at once
        (``--max-inflight-bytes``: reserved as each tensor begins, released once the push is
        read) before its bytes are read. A whole push is read only on its turn
        (``Shard.wait_turn``: a sync round reads one push at a time, in worker order); a
        streamed one (``turn`` False) as it arrives, since its bytes come while its worker's
        backward runs and holding them back would stall that backward's stream."""
        arrived = time.monotonic()  # the step's one deadline counts from its header
        request = fw.parse(ps_pb2.PushPullRequest, first.app_metadata, where)
        limit = self.shard.limits.max_request_bytes
        fw.check_manifest(request.chunks, limit, where)
        h = request.header
        if turn:
            self.shard.wait_turn(
                h.worker_id,
                h.step,
                timeout=_left(request.timeout_ms, arrived),
                incarnation=h.incarnation,
                cancelled=context.is_cancelled,
            )
        with self.admission.inflight() as reserve:
            assembler = ChunkAssembler(limit, reserve=reserve)
            fw.read_step(reader, first.data, request.chunks, assembler, where)
            grads = assembled_grads(assembler)
        return request, grads, _left(request.timeout_ms, arrived)

    def _push_pull(
        self,
        context: Any,
        first: Any,
        reader: Any,
        writer: Any,
        held: _Exchange,
        turn: bool = True,
    ) -> None:
        request, grads, timeout = self._read_push(context, first, reader, "push_pull", turn)
        h = request.header
        held.hold_stream(self.admission, h.worker_id)
        rows = row_query(request)
        # Other workers' pushes of this round may be pipelined (``_pipelined``): this one,
        # sent whole, feeds their preview too, or it could never be complete.
        if not rows:
            self._feed_preview(request, grads)
        gathered = frozenset(table for table, _ in rows)  # copies made for this reply
        result, held_reply, clock = self.shard.push_pull(
            h.worker_id,
            h.step,
            grads,
            encode=lambda arrays, _: self._held(arrays, gathered),
            timeout=timeout,
            incarnation=h.incarnation,
            take=True,  # the arrays were decoded for this call alone (a preview reads them
            # before the round sums them: SyncPolicy.defer)
            session=h.session,
            cancelled=context.is_cancelled,  # a worker gone (killed) ends the wait
            options=header_options(h),
            rows=rows,
        )
        self._reply(writer, push_response(result, self.shard.incarnation), held_reply, clock)

    def _pipelined(
        self, context: Any, first: Any, reader: Any, writer: Any, held: _Exchange
    ) -> None:
        """A streamed push (``fw.PIPELINED``) whose reply streams back while it arrives: the
        step's next weights, each predicted once every worker's gradient of it is in (sync) or
        once the push's own is and the push before it predicted it (async; psserver/
        pipeline.py), written by a thread of this call's own while this one reads the push;
        then, once the step is applied, a trailer with the push's result, sent only where
        every prediction held (else UNAVAILABLE: the worker sends the step again whole and is
        answered with the shard's weights). Where no prediction can hold
        (``Shard.preview``), the step is ``fw.STREAMED``'s."""
        where = "push_pull"
        arrived = time.monotonic()
        request = fw.parse(ps_pb2.PushPullRequest, first.app_metadata, where)
        h = request.header
        limit = self.shard.limits.max_request_bytes
        fw.check_manifest(request.chunks, limit, where)  # before it joins any preview
        preview = None
        if first.data is None and not request.rows:
            keys = [c.name for c in request.chunks]
            preview = self.shard.preview(
                h.worker_id, h.step, keys, header_options(h), h.incarnation, h.session
            )
        if preview is None:
            self._push_pull(context, first, reader, writer, held, turn=False)
            return
        held.hold_stream(self.admission, h.worker_id)
        timeout = _left(request.timeout_ms, arrived)
        deadline = arrived + (timeout if timeout is not None else self.shard.limits.max_wait_s)
        reply = _PreviewReply(writer, preview, self.piece_bytes, deadline, context.is_cancelled)
        try:
            with self.admission.inflight() as reserve:
                assembler = ChunkAssembler(limit, reserve=reserve)
                fw.read_step(
                    reader,
                    None,
                    request.chunks,
                    assembler,
                    where,
                    completed=functools.partial(preview.add, h.worker_id),
                )
                grads = assembled_grads(assembler)
            if not preview.private:
                # An async push's predictions become the shard's own values as it is applied,
                # which the next push changes in place: every one is written out first.
                reply.drain()
            result, holds, clock = self.shard.push_pull(
                h.worker_id,
                h.step,
                grads,
                encode=lambda _, __: self.shard.preview_held(preview),
                timeout=_left(request.timeout_ms, arrived),
                incarnation=h.incarnation,
                take=True,  # the round sums them at its close, once the preview has read them
                session=h.session,
                cancelled=context.is_cancelled,
                options=header_options(h),
            )
        except BaseException:
            reply.stop()  # a prediction it waits for may never come
            raise
        finally:
            self.shard.preview_done(preview)  # an async push that never reached the shard
        if self.metrics is not None:
            outcome = "held" if holds else "resent"
            self.metrics.pipelined.labels(self.metrics.name, outcome).inc()
        if not holds:
            reply.stop()
            raise UnavailableError(
                f"{where}: the weights sent ahead of step {h.step} are not those the step left "
                "(a sync round closed with other workers, an async push begun before it was "
                "not applied as predicted, or the values changed meanwhile); send it again"
            )
        reply.finish()  # every prediction is made: the thread writes what is left
        trailer = ps_pb2.PushPullResponse(clock=clock)
        trailer.push.CopyFrom(push_response(result, self.shard.incarnation))
        writer.write_metadata(trailer.SerializeToString())

    def _feed_preview(self, request: Any, grads: Mapping[str, Any]) -> None:
        """Gives the open round's preview, if pipelined pushes made one, this whole push's
        gradients."""
        h = request.header
        preview = self.shard.preview(
            h.worker_id, h.step, list(grads), header_options(h), h.incarnation, h.session, False
        )
        if preview is None:
            return
        for key, grad in grads.items():
            preview.add(h.worker_id, key, grad)

    def _push(self, context: Any, first: Any, reader: Any, writer: Any, held: _Exchange) -> None:
        request, grads, timeout = self._read_push(context, first, reader, "push")
        h = request.header
        result = self.shard.push(
            h.worker_id,
            h.step,
            grads,
            timeout=timeout,
            incarnation=h.incarnation,
            take=True,
            session=h.session,
            cancelled=context.is_cancelled,
            options=header_options(h),
        )
        self._reply(
            writer, push_response(result, self.shard.incarnation), _Held([], []), result.clock
        )

    def _pull(self, context: Any, first: Any, reader: Any, writer: Any, held: _Exchange) -> None:
        if first.data is not None:
            raise InvalidRequestError("pull: a pull request carries no tensor bytes")
        request = fw.parse(ps_pb2.PullRequest, first.app_metadata, "pull")
        rows = row_query(request)
        gathered = frozenset(table for table, _ in rows)
        held_reply, clock = self.shard.pull(
            request.worker_id,
            request.step,
            list(request.names),
            # The worker sends its deadline (0: the shard's own longest wait bounds it).
            timeout=fw.request_timeout(request.timeout_ms, DEADLINE_MARGIN_S),
            encode=lambda arrays, _: self._held(arrays, gathered),
            rows=rows,
            incarnation=request.incarnation,
            cancelled=context.is_cancelled,
        )
        skipped = request.worker_id >= 0 and self.shard.step_skipped(request.step - 1)
        # A pull's reply carries no push; ``push.skipped``: the step before it was skipped.
        pushed = ps_pb2.PushResponse(skipped=True) if skipped else None
        self._reply(writer, pushed, held_reply, clock)

    def _held(self, arrays: Mapping[str, np.ndarray], owned: frozenset[str]) -> _Held:
        """A pull's ``encode`` (the shard's lock held): what the reply is written from, with
        no copy of the model. The variables are the live arrays, copied a batch at a time
        under the shard's lock as they are written (``_LiveReply``); table rows gathered for
        this reply (``owned``) are copies already.
        """
        entries, raws = fw.encode_tensors(arrays)  # views of the arrays' bytes
        if set(arrays) <= owned:
            return _Held(entries, list(raws.values()))
        return _Held(entries, list(raws.values()), _LiveReply(self.shard, list(raws.values())))

    def _reply(
        self,
        writer: Any,
        pushed: ps_pb2.PushResponse | None,
        held: _Held,
        clock: int,
    ) -> None:
        reply = ps_pb2.PushPullResponse(chunks=held.entries, clock=clock)
        if pushed is not None:
            reply.push.CopyFrom(pushed)
        header = reply.SerializeToString()
        if held.live is None:
            fw.write_step(writer, header, held.raws, self.piece_bytes)
            return
        try:
            fw.write_step(writer, header, held.raws, self.piece_bytes, held.live.read)
        finally:
            held.live.release()


class _PreviewReply:
    """A pipelined step's reply (``FlightShardService._pipelined``) written on a thread of
    its own while the call's thread reads the push: the header (the manifest of the round's
    variables, no ``push``), then each variable's predicted value in the push's order as it
    is made. ``stop`` ends it early (the push failed, or the round closed: whatever was not
    predicted by then never will be)."""

    def __init__(
        self,
        writer: Any,
        preview: Preview,
        piece_bytes: int,
        deadline: float,
        cancelled: Callable[[], bool],
    ) -> None:
        self._writer = writer
        self._preview = preview
        self._piece_bytes = piece_bytes
        self._deadline = deadline
        self._cancelled = cancelled
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._complete = False
        self._thread = threading.Thread(target=self._run, name="ps-preview-reply", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            keys = self._preview.keys
            entries = [fw.manifest_entry(k, *self._preview.wire_of(k)) for k in keys]
            header = ps_pb2.PushPullResponse(chunks=entries).SerializeToString()
            out = fw.StepWriter(self._writer, header, self._piece_bytes)
            out.header()
            i = 0
            while i < len(keys):
                value = self._preview.value(keys[i], self._deadline, self._gone)
                if value is None:
                    return
                run = [fw.encode_tensor(keys[i], value)[1]]
                i += 1
                # Those made meanwhile go with it (small tensors packed into one message).
                while i < len(keys) and (more := self._preview.made(keys[i])) is not None:
                    run.append(fw.encode_tensor(keys[i], more)[1])
                    i += 1
                out.write(run)
            self._complete = True
        except BaseException as exc:  # the call failed: the handler raises it
            self._error = exc

    def _gone(self) -> bool:
        return self._stopped.is_set() or self._cancelled()

    def stop(self) -> None:
        """Ends the reply where it is, once the thread has returned (the call then fails)."""
        self._stopped.set()
        self._preview.wake()  # at once: the call's step stream is freed when it returns
        self._thread.join()

    def drain(self) -> None:
        """Returns once the thread has written every value, or given up (the preview failed,
        the call ended): the push is then all in, so every value is made or never will be."""
        self._thread.join()

    def finish(self) -> None:
        """Returns once the thread has written every value (each one made): bounded by the
        step's deadline, and by the call's (a write the worker does not read fails when the
        call ends).

        Raises:
            what the thread failed with; UnavailableError: the reply was cut short.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        if not self._complete:
            raise UnavailableError(
                "push_pull: the round's weights were not all sent in time; send the step again"
            )


def _left(timeout_ms: int, arrived: float) -> float | None:
    """The shard's wait for a push whose header arrived at ``arrived``: its deadline counts
    from there, as the worker's does (a push streamed from backward arrives over seconds)."""
    wait = fw.request_timeout(timeout_ms, DEADLINE_MARGIN_S)
    return None if wait is None else max(0.0, wait - (time.monotonic() - arrived))


class _LiveReply:
    """A reply's bytes while they view the shard's live arrays: each batch is copied under
    the shard's lock as it is written; should the shard change the values first, ``detach``
    (called by the shard, its lock held) copies every tensor not yet sent, and the rest of
    the reply comes from those copies (``Shard.steady_reader``)."""

    def __init__(self, shard: Shard, raws: list[np.ndarray]) -> None:
        self.raws = raws
        self.first_unsent = 0  # tensors before it are sent: a detach need not copy them
        self._read, self.release = shard.steady_reader(self.detach)

    def detach(self) -> None:
        self.raws = [r if i < self.first_unsent else r.copy() for i, r in enumerate(self.raws)]

    def read(self, spans: list[fw.Span]) -> np.ndarray:
        """A new array holding ``spans`` of the reply's tensors."""

        def copy() -> np.ndarray:
            self.first_unsent = spans[0][0]
            return np.concatenate([self.raws[i][start:end] for i, start, end in spans])

        return self._read(copy)  # type: ignore[no-any-return]


class _Held(NamedTuple):
    """A reply's manifest, its tensors' bytes and, when those view the shard's live arrays,
    how they are read (None: they are this reply's own)."""

    entries: list[Any]
    raws: list[np.ndarray]
    live: _LiveReply | None = None


@dataclass
class RunningFlightService:
    """A started data port: its service and where workers reach it."""

    service: FlightShardService
    host: str
    port: int

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float = 2.0) -> bool:
        """Stops serving; whether every call ended within ``grace`` seconds.

        Flight's shutdown waits for the calls in progress, and a worker's exchange kept open
        across steps lasts until the worker closes it: past ``grace`` the shutdown goes on in
        the background (the process's exit ends it) instead of blocking the caller.
        """
        self.service.stopping.set()
        done = threading.Thread(target=self.service.shutdown, name="ps-flight-stop", daemon=True)
        done.start()
        done.join(grace)
        if done.is_alive():
            log.warning("Flight data port %s: calls still open after %.1fs", self.address, grace)
            return False
        return True


def _pem(path: Path | None, what: str) -> bytes | None:
    """A PEM file's bytes (None for no path).

    Raises:
        ValueError: unreadable, or not PEM.
    """
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {str(path)!r} is not a PEM file")
    return data


def start_flight_service(
    shard: Shard,
    host: str = "127.0.0.1",
    port: int = 0,
    security: ServerSecurity | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    admission: Admission | None = None,
    metrics: ShardMetrics | None = None,
) -> RunningFlightService:
    """Starts the data port for ``shard`` on ``host:port`` (0: a free port), serving at once.

    ``security``: TLS with its certificate and key, client certificates verified against its
    CA (mutual TLS), the token required on every call; the same settings as the control port.

    Raises:
        ValueError: a TLS file cannot be read.
        OSError, pyarrow.ArrowException: the address could not be bound.
    """
    security = security or ServerSecurity()
    options: dict[str, Any] = {}
    scheme = "grpc+tcp"
    if security.tls:
        scheme = "grpc+tls"
        cert = _pem(security.cert, "TLS certificate")
        key = _pem(security.key, "TLS key")
        options["tls_certificates"] = [flight.CertKeyPair(cert=cert, key=key)]
        if security.mutual:
            options["verify_client"] = True
            options["root_certificates"] = _pem(security.ca, "TLS CA certificate")
    if security.token:
        options["middleware"] = {"token": fw.TokenCheck(security.token, "server", "DoExchange")}
    service = FlightShardService(
        shard, f"{scheme}://{host}:{port}", piece_bytes, admission, metrics, **options
    )
    return RunningFlightService(service, host, service.port)
