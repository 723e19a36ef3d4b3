"""One shard as a worker sees it: retries (warning while unreachable), restarts, push replay.

Tensors travel through a transport (psworker/transport.py): the shard's Arrow Flight data
port when its registration names one, else the control port's grpcio calls. The link keeps
what does not depend on the transport: retries, re-registration, replay, incarnations, the
job's identity."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
import numpy as np

from pscore.optspec import StepOptions
from pscore.tables import RowSparse
from pswire.errors import (
    ClientClosedError,
    PSError,
    TooLargeError,
    UnavailableError,
    WaitTimeoutError,
)
from pswire.flightwire import PACK_BYTES
from pswire.proto import ps_pb2
from pswire.rpc_errors import from_rpc_error
from pswire.security import ClientSecurity
from pswire.stubs import ParameterServerStub
from psworker.session import JobIdentity, LinkConfig
from psworker.transport import GrpcTransport, Reply, Transport, TransportFailure

if TYPE_CHECKING:
    from psworker.transport_flight import FlightTransport, StreamedStep

T = TypeVar("T")
log = logging.getLogger(__name__)
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 2.0
# While a shard stays unreachable, a WARNING at the first failure and then this often.
WARN_EVERY_S = 5.0
# Unreachable, or (ABORTED) a shard other than the one this link last saw: re-register, retry.
_RECOVERABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


# A restarted worker's new process waits this long at most for the old one's claim to lapse.
CLAIM_WAIT_S = 15.0


class Abortable(Protocol):
    """A step streamed from backward (psworker/push_stream.py), as the link sees it."""

    def abort(self) -> None:
        """Cancels it unless it was let go: the shard applies nothing of it."""
        ...


def backoff(attempt: int, rng: random.Random) -> float:
    """Jittered exponential backoff: up to 0.1 s, 0.2 s, ... capped at 2 s, times U(0.5, 1)."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt) * rng.uniform(0.5, 1.0)


class ShardLink:
    """A worker's connection to one shard.

    Calls that fail with UNAVAILABLE are retried with jittered exponential backoff for up to
    ``retry_s`` seconds. Before each retry the link re-registers; if the shard's incarnation
    changed (it restarted, from its last checkpoint), the link first re-sends the pushes this
    worker made after that checkpoint, so those steps are recomputed rather than lost. Pushes
    and pulls carry the incarnation the link last saw, so a shard that restarted between two
    calls (no call ever failed) refuses with ABORTED and the link recovers the same way. A
    shard that restarted with no checkpoint cannot be recovered: that is a clear error.
    """

    def __init__(
        self,
        index: int,
        address: str,
        channel: grpc.Channel,
        config: LinkConfig,
        identity: JobIdentity | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        self.index = index
        self.address = address
        self.stub = ParameterServerStub(channel)
        self.config = config
        self.worker_id = config.worker_id
        self.num_workers = config.num_workers
        self.timeout = config.timeout
        self.retry_s = config.retry_s
        self.chunk_bytes = config.chunk_bytes
        self.identity = identity or JobIdentity()
        self.security = security or ClientSecurity()
        self.incarnation: str | None = None
        self.checkpointing = False
        self.durable = 0
        self.log: dict[int, dict[str, np.ndarray | RowSparse]] = {}  # step -> pushed, for replay
        self.log_bytes = 0
        self.logged_options: dict[int, StepOptions] = {}  # step -> its options, for replay
        self.pull_skipped = False  # the last pull said: the step before it was skipped (sync)
        self.recoveries = 0
        self._rng = random.Random(config.worker_id * 7919 + index)
        self._closed = threading.Event()
        # Steps travel on one open call (see StepStream, FlightLink) of the transport chosen.
        self.grpc = GrpcTransport(
            self.stub,
            self.worker_id,
            self.timeout,
            self.chunk_bytes,
            config.session,
            self.where("PushPullStream"),
        )
        self.flight: FlightTransport | None = None  # the shard's data port, once registered
        self.flight_steps: FlightTransport | None = None  # its small steps (one message each)
        self.data_port = 0
        self._stepping: Transport = self.grpc  # the transport of the step last sent
        self.streaming: Abortable | None = None  # a step streamed from backward, if open
        self._reply_bytes = 0  # the tensor bytes of the last reply: what the next may carry

    @property
    def steps(self) -> Transport:
        """The transport carrying the step last sent (``when_ended`` of its call)."""
        return self._stepping

    def transport(self, nbytes: int = 0, step: bool = False) -> Transport:
        """The transport for a call moving about ``nbytes`` tensor bytes one way (or as many
        as the last reply brought back, if more; both counted by ``_flight_bytes``): the data
        port where the shard has one, this worker uses it and the call is not under
        ``grpc_below_bytes``; a ``step`` under it on the data port too, in one message each
        way (``flight_steps``: half grpcio's time on an open stream, bench/NOTES.md 36); else
        grpcio."""
        size = max(nbytes, self._reply_bytes)
        if self.flight is not None and size >= self.config.grpc_below_bytes:
            return self.flight
        if step and self.flight_steps is not None:
            return self.flight_steps
        return self.grpc

    def _replied(self, arrays: Mapping[str, np.ndarray]) -> None:
        self._reply_bytes = self._flight_bytes(arrays)

    def _flight_bytes(self, tensors: Mapping[str, np.ndarray | RowSparse]) -> int:
        """The bytes of ``tensors`` that count towards taking the data port: each tensor's of
        ``PACK_BYTES`` or more (or of ``grpc_below_bytes``, when that is less). Flight sends
        such a tensor from its own memory; smaller ones it packs with a copy, and a step of
        many of them is faster on grpcio: 100,000 four-float variables on 2 shards took 3.03 s
        a step on Flight, 1.97 s on grpcio (bench.manyvars, quiet machine)."""
        least = min(PACK_BYTES, self.config.grpc_below_bytes)
        return sum(n for n in (v.nbytes for v in tensors.values()) if n >= least)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Ends the open calls (a streamed step is cancelled: the shard applies nothing of
        it), and any retrying call (it raises ClientClosedError)."""
        self._closed.set()
        streaming = self.streaming
        if streaming is not None:
            streaming.abort()
        self.grpc.close()
        if self.flight is not None:
            self.flight.close()

    def _dial_data(self, port: int) -> None:
        """Uses the shard's data port ``port`` (0: none) on the host this link reached."""
        if port == self.data_port and (self.flight is not None or not port):
            return
        if self.flight is not None:
            self.flight.close()
            self.flight = self.flight_steps = None
        self.data_port = port
        if not port or self.config.data_plane == "grpc":
            return
        from psworker.transport_flight import FlightTransport  # pyarrow: only when used

        host = self.address.rpartition(":")[0] or self.address
        self.flight = FlightTransport(
            self.index,
            f"{host}:{port}",
            self.worker_id,
            self.timeout,
            self.security,
            self.config.session,
            self.where("PushPullStream"),
        )
        self.flight_steps = self.flight.small_steps()

    def where(self, rpc: str) -> str:
        return f"{rpc} on shard {self.index} ({self.address})"

    def call(self, rpc: str, fn: Callable[[ParameterServerStub], T]) -> T:
        """Runs ``fn(stub)``, retrying through UNAVAILABLE until ``retry_s`` is spent.

        Raises:
            PSError: the call failed for another reason, or the shard stayed unreachable.
        """
        start = time.monotonic()
        deadline = start + self.retry_s
        attempt = 0
        warn_at, warned = start, False
        while True:
            try:
                if self._closed.is_set():
                    raise ClientClosedError(f"{self.where(rpc)}: the client was closed")
                if attempt:
                    self._resync()
                result = fn(self.stub)
                if warned:  # the log said it was unreachable: say it is back
                    log.warning("%s: shard reachable again", self.where(rpc))
                return result
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                now = time.monotonic()
                if self._closed.is_set():
                    raise ClientClosedError(f"{self.where(rpc)}: the client was closed") from None
                if code not in _RECOVERABLE or now >= deadline:
                    raise self._failure(exc, rpc, now - start, attempt + 1) from None
                if isinstance(exc, TransportFailure) and not attempt:
                    # The data port failed: re-register at once (a restarted shard serves
                    # another data port; its control port says which), warning only if that
                    # fails too, as for the control port.
                    log.info("%s: %s; retry 1 in 0.00s", self.where(rpc), code.name)
                    attempt += 1
                    continue
                pause = min(backoff(attempt, self._rng), max(0.0, deadline - now))
                if code == grpc.StatusCode.UNAVAILABLE and now >= warn_at:
                    warn_at, warned = now + WARN_EVERY_S, True
                    log.warning("%s", self._unreachable(exc, rpc, now - start, deadline - now))
                name = code.name if code is not None else "?"
                log.info("%s: %s; retry %d in %.2fs", self.where(rpc), name, attempt + 1, pause)
                self._closed.wait(pause)
                attempt += 1

    def _unreachable(self, exc: grpc.RpcError, rpc: str, waited: float, left: float) -> str:
        """The warning while retrying an unreachable shard: which, how long, until when, why."""
        details = exc.details() if hasattr(exc, "details") else str(exc)
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
        hint = self.security.diagnose(self.address, details or "")
        how_long = (
            f"still unreachable after {waited:.0f}s; retrying until {until} ({left:.0f}s more)"
            if waited >= 1
            else f"unreachable; retrying for up to {left:.0f}s, until {until} "
            f"(retry_s={self.retry_s:g})"
        )
        return f"{self.where(rpc)}: shard {how_long}: {details}" + (
            f". Likely cause: {hint}" if hint else ""
        )

    def _failure(self, exc: grpc.RpcError, rpc: str, waited: float, attempts: int) -> PSError:
        """The error a failed call raises; for an unreachable shard it says for how long and
        what the likely cause is."""
        code = exc.code() if hasattr(exc, "code") else None
        details = (exc.details() if hasattr(exc, "details") else "") or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            hint = self.security.diagnose(self.address, details)
            return UnavailableError(
                f"{self.where(rpc)}: shard unreachable for {waited:.1f}s ({attempts} attempts, "
                f"retry_s={self.retry_s:g}): {details}"
                + (f". Likely cause: {hint}" if hint else "")
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            # grpc's own deadline, not a shard's wait (a shard names what it waited for).
            return WaitTimeoutError(
                f"{self.where(rpc)}: no answer within timeout={self.timeout:g}s (the shard "
                "neither answered nor said what it waits for: is it overloaded or stuck?)"
            )
        return from_rpc_error(exc, self.where(rpc))

    def pull(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """A Pull, decoded (into ``into``'s arrays where given).

        Raises:
            PSError: the call failed (after retries through UNAVAILABLE).
        """

        def run(_: ParameterServerStub) -> dict[str, np.ndarray]:
            request.incarnation = self.incarnation or ""  # per attempt: a retry after a restart
            self.pull_skipped = False
            nbytes = self._flight_bytes(into or {})
            arrays, self.pull_skipped = self.transport(nbytes).pull(request, into)
            self._replied(arrays)
            return arrays

        return self.call("Pull", run)

    def push(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        options: StepOptions | None = None,
    ) -> ps_pb2.PushResponse:
        """A Push of this shard's pieces of one step (kept for replay first).

        Raises:
            PSError: the call failed (after retries through UNAVAILABLE).
        """
        self.note_push(step, pieces, options)
        nbytes = self._flight_bytes(pieces)
        reply = self.call(
            "Push",
            lambda _: self.transport(nbytes).push(step, pieces, self.incarnation or "", options),
        )
        self.note_reply(reply)
        return reply

    def push_pull(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
    ) -> Reply:
        """One step on the call kept open: the push, then the weights for the step after it
        (decoded into ``into``'s arrays where given).

        Raises:
            PSError: the call failed (after retries through UNAVAILABLE).
        """
        return self.start_push_pull(step, pieces, into, options)()

    def start_push_pull(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
        rows: Sequence[ps_pb2.RowQuery] = (),
    ) -> Callable[[], Reply]:
        """``push_pull`` in two halves: sends the step now and returns the call that waits for
        its reply, so a worker sends every shard its step before it waits for any (one thread,
        no hand-offs). If the first try fails, the returned call retries as ``push_pull``.

        Raises (the returned call):
            PSError: as ``push_pull``.
        """
        self.note_push(step, pieces, options)
        nbytes = max(self._flight_bytes(pieces), self._flight_bytes(into or {}))

        def send() -> Transport:
            return self._send_step(step, pieces, into, options, rows, nbytes)

        def finish() -> Reply:
            result = None
            if sent is not None:
                try:
                    result = sent.receive_step()
                except grpc.RpcError as exc:
                    if exc.code() not in _RECOVERABLE:
                        raise self._failure(exc, "PushPull", 0.0, 1) from None
            if result is None:  # not sent, or unreachable: the retrying path starts over
                result = self._retried_step(step, pieces, into, options, rows, nbytes)
            self.note_reply(result[0])
            self._replied(result[1])
            return result

        sent: Transport | None = None
        with contextlib.suppress(grpc.RpcError):  # unsent: ``finish`` takes the retrying path
            if not self._closed.is_set():
                sent = send()
        return finish

    def _send_step(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None,
        options: StepOptions | None,
        rows: Sequence[ps_pb2.RowQuery],
        nbytes: int,
    ) -> Transport:
        # Chosen and built per attempt: a retry after a restart may find another data port,
        # and carries the new incarnation.
        transport = self._stepping = self.transport(nbytes, step=True)
        transport.send_step(step, pieces, into, self.incarnation or "", options, rows)
        return transport

    def _retried_step(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None,
        options: StepOptions | None,
        rows: Sequence[ps_pb2.RowQuery] = (),
        nbytes: int | None = None,
    ) -> Reply:
        """A step sent whole, retried as ``call`` retries (after its first try failed)."""
        if nbytes is None:
            nbytes = max(self._flight_bytes(pieces), self._flight_bytes(into or {}))

        def run(_: ParameterServerStub) -> Reply:
            return self._send_step(step, pieces, into, options, rows, nbytes).receive_step()

        return self.call("PushPull", run)

    # -- a step streamed from backward (psworker/push_stream.py drives these) ---------------

    def streams(
        self, entries: Sequence[ps_pb2.TensorChunk], into: Mapping[str, np.ndarray]
    ) -> bool:
        """Whether a step whose manifest is ``entries`` (its reply decoded into ``into``)
        goes on the data port, where it can be streamed as backward produces it; steps under
        ``grpc_below_bytes`` go whole on grpcio."""
        least = min(PACK_BYTES, self.config.grpc_below_bytes)
        sent = sum(e.total_bytes for e in entries if e.total_bytes >= least)
        nbytes = max(sent, self._flight_bytes(into))
        return self.flight is not None and self.transport(nbytes) is self.flight

    def begin_stream(
        self,
        step: int,
        entries: Sequence[ps_pb2.TensorChunk],
        into: Mapping[str, np.ndarray],
        options: StepOptions | None,
        placed: Callable[[str], None] | None = None,
    ) -> StreamedStep:
        """Opens a streamed step on the data port, its header (the manifest) written;
        ``placed(key)`` is told as each tensor of its reply lands in ``into``.

        Raises:
            grpc.RpcError: the data port failed or refused (a ``TransportFailure``).
        """
        if self.flight is None or self._closed.is_set():
            raise TransportFailure(UnavailableError(f"{self.where('PushPull')}: no data port"))
        self._stepping = self.flight
        incarnation = self.incarnation or ""
        return self.flight.begin_stream(step, entries, into, incarnation, options, placed)

    def stream_ended(self, result: Reply) -> Reply:
        """Learns from a streamed step's reply, as from any step's."""
        self.note_reply(result[0])
        self._replied(result[1])
        return result

    def resend_step(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray],
        options: StepOptions | None,
    ) -> Reply:
        """A step whose stream failed, sent whole (already in the replay log), retried as
        ``push_pull`` retries: the shard applies it once, whatever the stream delivered.

        Raises:
            PSError: as ``push_pull``.
        """
        return self.stream_ended(self._retried_step(step, pieces, into, options))

    def error(self, exc: grpc.RpcError, rpc: str) -> PSError:
        """The PSError a call's first failure stands for (no retry made); a closed client's
        is ClientClosedError."""
        if self._closed.is_set():
            return ClientClosedError(f"{self.where(rpc)}: the client was closed")
        return self._failure(exc, rpc, 0.0, 1)

    def push_then_pull(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        options: StepOptions | None,
        pull: ps_pb2.PullRequest,
        into: Mapping[str, np.ndarray],
    ) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
        """A streamed push, then ``pull``, at least at the step the push's reply says is next;
        on the data port, one exchange carrying both (it holds no message limit)."""
        if self.flight is not None:
            pushed, arrays = self.start_push_pull(step, pieces, into, options, pull.rows)()
            pull.step = max(pull.step, int(pushed.next_step))  # the step it read, as below
            return pushed, arrays
        pushed = self.push(step, pieces, options)
        pull.step = max(pull.step, int(pushed.next_step))
        arrays = self.pull(pull, into)
        pushed.skipped = pushed.skipped or self.pull_skipped
        return pushed, arrays

    def register(self) -> ps_pb2.RegisterWorkerResponse:
        """RegisterWorker on this shard, remembering what it says about durability and the
        job. While another process's claim on this worker id is fresh (this worker restarted
        quickly), waits for it to lapse, up to ``CLAIM_WAIT_S``.

        Raises:
            grpc.RpcError: the call failed (UNAVAILABLE: the caller retries).
            DuplicateWorkerError: another live process holds this worker id.
            ModelMismatchError: the shard holds another job than this worker's.
        """
        request = ps_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id, num_workers=self.num_workers, session=self.config.session
        )
        give_up = time.monotonic() + min(CLAIM_WAIT_S, self.retry_s)
        while True:
            try:
                reply = self.stub.RegisterWorker(request, timeout=self.timeout)
                break
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() >= give_up:
                    raise
                log.warning("%s: waiting for the old claim to lapse", self.where("Register"))
                time.sleep(1.0)
        self.identity.check(reply.job_id, f"shard {self.index} ({self.address})")
        self.checkpointing = reply.checkpointing
        self.durable = reply.durable_step
        self._dial_data(reply.data_port)
        return reply

    def leave(self, joined: bool = True) -> None:
        """Tells the shard this worker is done (best effort, short deadline). ``joined``
        False: its init failed, so only its claim on the worker id ends (a corrected rerun
        takes the id at once) and the quorum stays as it was; nothing to say if it never
        registered here."""
        if not joined and self.incarnation is None:
            return
        request = ps_pb2.LeaveRequest(
            worker_id=self.worker_id, session=self.config.session, release_only=not joined
        )
        try:
            self.stub.Leave(request, timeout=min(self.timeout, 5.0))
        except grpc.RpcError as exc:
            log.debug("%s failed: %s", self.where("Leave"), exc.code())

    def note_push(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        options: StepOptions | None = None,
    ) -> None:
        """Keeps a copy of a push (and its options) until a checkpoint covers it (only if the
        shard checkpoints). A full log asks the shard to checkpoint first (see
        ``DEFAULT_REPLAY_BYTES``).

        Raises:
            TooLargeError: the log is full and the shard could not checkpoint.
        """
        if not self.checkpointing:
            return
        if options is not None:
            self.logged_options[step] = options
        nbytes = sum(v.nbytes for v in pieces.values())  # a RowSparse's: its ids and rows
        # At least a few pushes fit, so a large model does not checkpoint every step.
        limit = max(self.config.replay_bytes, 4 * nbytes)
        if self.log and self.log_bytes + nbytes > limit:
            self._make_room(limit)  # its reply to this push trims the log
        self.log[step] = {
            k: RowSparse(v.ids.copy(), v.values.copy())
            if isinstance(v, RowSparse)
            else np.array(v, copy=True)
            for k, v in pieces.items()
        }
        self.log_bytes += nbytes

    def _make_room(self, limit: int) -> None:
        """Asks the shard for a checkpoint; this push's reply then says what it holds, and
        those pushes are forgotten.

        Raises:
            TooLargeError: the shard could not checkpoint (the log may not grow further).
        """
        try:
            self.stub.Checkpoint(ps_pb2.CheckpointRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise TooLargeError(
                f"{self.where('Push')}: this worker's replay log holds {self.log_bytes} bytes of "
                f"pushes no checkpoint covers (limit {limit}, PS_REPLAY_BYTES), and the shard "
                f"could not checkpoint ({exc.details()}); refusing to grow it further"
            ) from None

    def note_reply(self, reply: ps_pb2.PushResponse) -> None:
        """Learns from a push's reply: forgets pushes the shard's newest checkpoint holds, and
        checks the shard still holds this worker's job.

        Raises:
            ModelMismatchError: the shard holds another job.
        """
        if self.incarnation is None:
            self.incarnation = reply.incarnation
        self.identity.check(reply.job_id, f"shard {self.index} ({self.address})")
        self.durable = max(self.durable, reply.durable_step)
        self._forget()

    def _forget(self) -> None:
        for step in [s for s in self.log if s < self.durable]:
            pushed = self.log.pop(step)
            self.log_bytes -= sum(v.nbytes for v in pushed.values())
            self.logged_options.pop(step, None)

    def _resync(self) -> None:
        """Re-registers; replays logged pushes if the shard restarted since we last saw it.

        Raises:
            grpc.RpcError: the shard is still unreachable (the caller retries).
            UnavailableError: it restarted without the state needed to continue.
        """
        reply = self.register()
        if self.incarnation is None or reply.incarnation == self.incarnation:
            self.incarnation = reply.incarnation
            return
        if not reply.initialized:
            why = (
                "its checkpoint directory held no checkpoint (it saves one as soon as it takes "
                "the initial values: was it restarted with another --checkpoint-dir, or its "
                "files removed?)"
                if reply.checkpointing
                else "it has no --checkpoint-dir; run psserver with one to survive restarts"
            )
            raise UnavailableError(
                f"shard {self.index} ({self.address}) restarted without a checkpoint, so its "
                f"variables are gone: {why}"
            )
        resume = reply.clock
        steps = sorted(s for s in self.log if s >= resume)
        missing = sorted(set(range(resume, max(self.log, default=resume - 1) + 1)) - set(steps))
        if missing:
            raise UnavailableError(
                f"shard {self.index} ({self.address}) restarted at step {resume}, but this "
                f"worker no longer holds its pushes for steps {missing[:5]}"
            )
        log.warning(
            "shard %d (%s) restarted (incarnation %s -> %s) at step %d: replaying %d pushes",
            self.index,
            self.address,
            self.incarnation,
            reply.incarnation,
            resume,
            len(steps),
        )
        for step in steps:
            pushed = self.log[step]
            self.transport(self._flight_bytes(pushed)).push(
                step, pushed, reply.incarnation, self.logged_options.get(step)
            )
        self.incarnation = reply.incarnation
        self.recoveries += 1


def shard_status(
    addresses: Sequence[str], timeout: float = 10.0, security: ClientSecurity | None = None
) -> list[ps_pb2.StatusResponse]:
    """Status of each shard at ``addresses``.

    ``security`` defaults to the ``$PS_TLS_*`` / ``$PS_TOKEN`` settings, as ``connect`` does.

    Raises:
        PSError: a shard did not answer within ``timeout``.
        ConfigError: bad TLS or token settings.
    """
    security = security or ClientSecurity.from_env()
    out = []
    for i, address in enumerate(addresses):
        with security.channel(address) as channel:
            stub = ParameterServerStub(channel)
            try:
                out.append(stub.Status(ps_pb2.StatusRequest(), timeout=timeout))
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, f"Status on shard {i} ({address})")
                hint = security.diagnose(address, exc.details() or "")
                if hint and isinstance(error, UnavailableError):
                    error = UnavailableError(f"{error}. Likely cause: {hint}")
                raise error from None
    return out


status = shard_status  # the name psctl and older code import
