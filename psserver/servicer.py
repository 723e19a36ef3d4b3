"""gRPC servicer for a shard: decode the request, call ``Shard``, encode the reply."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from pscore.tables import RowSparse
from psserver.admission import DEFAULT_THREADS, Admission
from psserver.records import PushResult
from psserver.shard import Cancelled, Shard
from pswire import read, write
from pswire.codec import (
    DEFAULT_CHUNK_BYTES,
    ChunkAssembler,
    assembled_grads,
    header_options,
    push_pull_grads,
    read_stream,
)
from pswire.errors import InvalidRequestError, NotInitializedError, PSError
from pswire.jobspec import job_from_proto, job_to_proto
from pswire.optstate import split_state, state_arrays
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.rpc_errors import rpc_errors
from pswire.write import encode_chunk_messages, varint_field

log = logging.getLogger(__name__)

# Finish a server-side wait this long before the caller's deadline, so the caller gets our
# specific error (what the wait was for) rather than a bare DEADLINE_EXCEEDED.
DEADLINE_MARGIN_S = 0.25


def row_query(
    request: ps_pb2.PullRequest | ps_pb2.PushPullRequest | read.StepRequest,
) -> list[tuple[str, np.ndarray]]:
    """(table, ids) pairs of a pull (or a PushPull's read); ids decoded without a copy.

    Raises:
        InvalidRequestError: ids that are not whole int64s.
    """
    rows = []
    for table, ids in pull_row_query(request):
        if ids is None:
            raise InvalidRequestError(
                f"table '{table}': every row a shard holds (RowQuery.every) is for a Pull "
                "(psctl export), not a step's read"
            )
        rows.append((table, ids))
    stated = sorted(slot_tables(request))
    if stated:
        raise InvalidRequestError(
            f"table '{stated[0]}': the rows' optimizer state (RowQuery.slots) is for a Pull "
            "(psctl export), not a step's read"
        )
    return rows


def slot_tables(
    request: ps_pb2.PullRequest | ps_pb2.PushPullRequest | read.StepRequest,
) -> frozenset[str]:
    """The tables of a pull whose rows' optimizer state is asked for too (``slots``)."""
    return frozenset(q.table for q in request.rows if q.slots)


def pull_row_query(
    request: ps_pb2.PullRequest | ps_pb2.PushPullRequest | read.StepRequest,
) -> list[tuple[str, np.ndarray | None]]:
    """(table, ids) pairs of a pull, as ``row_query``; ids None: every row (``every``).

    Raises:
        InvalidRequestError: ids that are not whole int64s, or ids with ``every``.
    """
    rows: list[tuple[str, np.ndarray | None]] = []
    for q in request.rows:
        if len(q.ids) % 8:
            raise InvalidRequestError(
                f"table '{q.table}': row ids are {len(q.ids)} bytes, not a whole number of int64s"
            )
        if q.every:
            if q.ids:
                raise InvalidRequestError(
                    f"table '{q.table}': a row query names ids and asks for every row"
                )
            rows.append((q.table, None))
            continue
        ids = np.frombuffer(q.ids, dtype="<i8")
        rows.append((q.table, ids if ids.flags.aligned else ids.copy()))
    return rows


def push_response(result: PushResult, incarnation: str) -> ps_pb2.PushResponse:
    """A push's result as both front ends (this servicer, the Flight data port) answer it."""
    return ps_pb2.PushResponse(
        applied=result.applied,
        reason=result.reason,
        clock=result.clock,
        incarnation=incarnation,
        durable_step=result.durable_step,
        next_step=result.next_step,
        absent_workers=result.absent,
        job_id=result.job_id,
        skipped=result.skipped,
    )


def step_reply(
    shard: Shard,
    request: ps_pb2.PushPullRequest | read.StepRequest,
    timeout: float | None,
    cancelled: Cancelled | None = None,
) -> bytes:
    """One step in the step stream's message form, as both front ends take it (this
    servicer's ``PushPullStream``, the data port's small steps): the request's gradients into
    one ``Shard.push_pull``, its reply's bytes (the weights a snapshot taken under the lock).

    Raises:
        PSError: as ``Shard.push_pull``, and bad gradients or row ids.
    """
    header = request.header
    rows = row_query(request)
    gathered = frozenset(table for table, _ in rows)  # copies made for this reply

    def encode(arrays: Mapping[str, np.ndarray], clock: int) -> write.ReplyTensors:
        return write.reply_tensors(arrays, gathered)  # under the lock: the snapshot

    result, tensors, clock = shard.push_pull(
        header.worker_id,
        header.step,
        push_pull_grads(request, shard.limits.max_request_bytes),
        timeout=timeout,
        incarnation=header.incarnation,
        take=True,
        encode=encode,
        session=header.session,
        cancelled=cancelled,
        options=header_options(header),
        rows=rows,
    )
    return write.reply(push_response(result, shard.incarnation), tensors, clock)


def _timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)


class _Reply(list):
    """A pull reply's messages; a list that can be weakly referenced, keyed by what it holds."""

    key: tuple = ()


def _none() -> None:
    return None


@contextlib.contextmanager
def _ending(context: grpc.ServicerContext, shard: Shard) -> Iterator[threading.Event]:
    """An event set when the call ends; if it ends (cancelled, deadline passed, client gone)
    while the handler still runs, the shard's waits are woken to see it and give up."""
    ended = threading.Event()
    running = True

    def on_end() -> None:
        ended.set()
        if running:
            shard.wake()

    context.add_callback(on_end)
    try:
        yield ended
    finally:
        running = False


def _until_gone(requests: Iterable[Any]) -> Iterator[Any]:
    """The requests of a stream, ending quietly when the client cancels or goes away (grpc
    raises RpcError from the iterator then: there is no one left to answer)."""
    iterator = iter(requests)
    while True:
        try:
            yield next(iterator)
        except (StopIteration, grpc.RpcError):
            return


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Thin adapter from the ParameterServer service onto one ``Shard``: each method decodes
    its request, makes one call into the shard, and encodes what comes back."""

    def __init__(
        self,
        shard: Shard,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checkpoint: Callable[[], tuple[str, int]] | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.shard = shard
        self.chunk_bytes = chunk_bytes
        self.save_checkpoint = checkpoint
        self.admission = admission or Admission(threads=DEFAULT_THREADS)
        self.data_port = 0  # the shard's Flight data port, told to workers (0: none)
        self._shared_pull: Callable[[], _Reply | None] = _none  # see _encode_pull

    @rpc_errors
    def RegisterWorker(self, request, context):
        reg = self.shard.register_worker(request.worker_id, request.num_workers, request.session)
        return ps_pb2.RegisterWorkerResponse(
            clock=reg.clock,
            initialized=reg.initialized,
            incarnation=self.shard.incarnation,
            durable_step=reg.durable_step,
            checkpointing=self.shard.checkpointing,
            job_id=reg.job_id,
            heartbeat_timeout_s=self.shard.limits.heartbeat_timeout_s,
            data_port=self.data_port,
        )

    @rpc_errors
    def Heartbeat(self, request, context):
        beat = self.shard.beat(request.worker_id, request.session, request.seconds_per_step)
        return ps_pb2.HeartbeatResponse(
            clock=beat.clock, fastest_seconds_per_step=beat.fastest_seconds_per_step
        )

    @rpc_errors
    def Leave(self, request, context):
        if request.release_only:
            self.shard.release(request.worker_id, request.session)
        else:
            self.shard.leave(request.worker_id, request.session)
        return ps_pb2.LeaveResponse()

    @rpc_errors
    def Join(self, request, context):
        phase = ps_pb2.JoinRequest.Phase.Name(request.phase).lower()
        result = self.shard.join(request.worker_id, request.session, phase, request.step)
        return ps_pb2.JoinResponse(
            accepted=result.accepted, step=result.step, members=result.members
        )

    @rpc_errors
    def ListMembers(self, request, context):
        with _ending(context, self.shard) as cancelled:
            view = self.shard.list_members(
                request.worker_id, request.step, _timeout(context), cancelled
            )
        return ps_pb2.ListMembersResponse(
            members=view.members,
            rosters=[ps_pb2.Roster(step=s, members=m) for s, m in view.rosters],
            min_workers=view.min_workers,
            max_workers=view.max_workers,
        )

    @rpc_errors
    def Init(self, request_iterator, context):
        with self.admission.inflight() as reserve:
            assembler = ChunkAssembler(self.shard.limits.max_request_bytes, reserve=reserve)
            header = read_stream(request_iterator, assembler, "Init")
            values: dict | None = assembler.finish()
            if assembler.indices:
                raise InvalidRequestError(
                    f"Init carries row ids for {sorted(assembler.indices)}: tables are never sent"
                )
            if values and not header.has_values:
                raise InvalidRequestError(
                    "Init carries values but its header says has_values=false"
                )
            if not header.has_values:
                values = None
            job = job_from_proto(header.job)
            if header.check_only:
                if values is not None:
                    raise InvalidRequestError("Init with check_only carries values")
                self.shard.check_init(header.worker_id, job)
                return ps_pb2.InitResponse(job_id=self.shard.job_id)
            # The assembler's arrays belong to this call alone: the shard may keep them.
            accepted = self.shard.init(header.worker_id, job, values, take=True)
        if accepted and self.save_checkpoint is not None:
            self._first_checkpoint()
        return ps_pb2.InitResponse(values_accepted=accepted, job_id=self.shard.job_id)

    def _first_checkpoint(self) -> None:
        """Saves the initial values before worker 0 hears they were taken (so before any
        step): a shard killed before its first periodic save then restarts from them, and
        the workers replay every push since step 0. A failed save is logged, not fatal: the
        periodic saves retry."""
        assert self.save_checkpoint is not None
        try:
            path, _ = self.save_checkpoint()
        except PSError as exc:
            log.warning("could not save the initial values' checkpoint: %s", exc)
        else:
            log.info("initial values saved to %s", path)

    def _encode_pull(self, arrays: Mapping[str, np.ndarray], clock: int) -> list[bytes]:
        """The PullResponse messages of a snapshot; runs under the shard's lock (the encoded
        reply is the snapshot: one copy).

        Pulls of the same variables at the same clock share one encoded reply while any of
        them is still sending it: in sync mode every worker pulls as a step closes, and each
        reply is a whole copy of the shard's variables. (The clock moves with every update;
        values change no other way while the shard serves.)
        """
        key = (clock, tuple(arrays))
        shared = self._shared_pull()
        if shared is not None and shared.key == key:
            return shared
        reply = self._messages(arrays, clock)
        reply.key = key
        self._shared_pull = weakref.ref(reply)
        return reply

    def _messages(self, arrays: Mapping[str, np.ndarray | RowSparse], clock: int) -> _Reply:
        """A pull reply's messages (a pull with table rows gets its own, never shared); every
        row of a dynamic table (``RowSparse``) carries its ids."""
        trailer = varint_field(2, clock)  # PullResponse.clock, after the chunk (field 1)
        return _Reply(
            message
            for name, piece in arrays.items()
            for message in encode_chunk_messages(
                name,
                piece.values if isinstance(piece, RowSparse) else piece,
                1,
                self.chunk_bytes,
                trailer=trailer,
                indices=piece.ids if isinstance(piece, RowSparse) else None,
            )
        )

    @rpc_errors
    def Pull(self, request, context):
        rows = pull_row_query(request)
        with _ending(context, self.shard) as cancelled:
            messages, _ = self.shard.pull(
                request.worker_id,
                request.step,
                list(request.names),
                timeout=_timeout(context),
                encode=self._messages if rows else self._encode_pull,
                rows=rows,
                slots=slot_tables(request),
                incarnation=request.incarnation,
                cancelled=cancelled,
            )
        yield from messages
        if request.worker_id >= 0 and self.shard.step_skipped(request.step - 1):
            yield ps_pb2.PullResponse(skipped=True)  # sync: the step just pushed was skipped

    @rpc_errors
    def Push(self, request_iterator, context):
        with self.admission.inflight() as reserve, _ending(context, self.shard) as cancelled:
            assembler = ChunkAssembler(self.shard.limits.max_request_bytes, reserve=reserve)
            header = read_stream(request_iterator, assembler, "Push")
            grads = assembled_grads(assembler)
            if header.tensors and len(grads) != header.tensors:
                # grpc can end a dead client's stream as if it had closed it.
                raise InvalidRequestError(
                    f"Push of step {header.step} by worker {header.worker_id} ended after "
                    f"{len(grads)} of the {header.tensors} tensors it announced (the worker "
                    "went away mid-push?): nothing applied"
                )
            result = self.shard.push(
                header.worker_id,
                header.step,
                grads,
                timeout=_timeout(context),
                incarnation=header.incarnation,
                take=True,  # the assembler's arrays belong to this call alone
                session=header.session,
                cancelled=cancelled,
                options=header_options(header),
            )
        return self._push_response(result)

    @rpc_errors
    def PushPull(self, request, context):
        with _ending(context, self.shard) as cancelled:
            return self._push_pull(request, _timeout(context), cancelled)

    @rpc_errors
    def PushPullStream(self, request_iterator, context):
        requests = _until_gone(request_iterator)
        first = next(requests, None)
        if first is None:
            return
        worker = first.header.worker_id
        with _ending(context, self.shard) as cancelled, self.admission.step_stream(worker):
            for request in itertools.chain([first], requests):
                # Each step's own deadline, within the call's; answered DEADLINE_MARGIN_S
                # before it, as a call's deadline is, so the worker's watchdog never beats
                # our reply.
                timeout = (
                    max(0.0, request.timeout_ms / 1000 - DEADLINE_MARGIN_S)
                    if request.timeout_ms
                    else None
                )
                remaining = _timeout(context)
                if remaining is not None:
                    timeout = remaining if timeout is None else min(timeout, remaining)
                yield self._push_pull(request, timeout, cancelled)

    def _push_pull(
        self,
        request: ps_pb2.PushPullRequest | read.StepRequest,
        timeout: float | None,
        cancelled: threading.Event,
    ) -> bytes | ps_pb2.PushPullResponse:
        return step_reply(self.shard, request, timeout, cancelled)

    def _push_response(self, result: PushResult) -> ps_pb2.PushResponse:
        return push_response(result, self.shard.incarnation)

    @rpc_errors
    def PullState(self, request, context):
        arrays = state_arrays(self.shard.optimizer_state(_timeout(context)))
        for name, array in arrays.items():
            yield from encode_chunk_messages(name, array, 1, self.chunk_bytes)

    @rpc_errors
    def LoadState(self, request_iterator, context):
        with self.admission.inflight() as reserve:
            assembler = ChunkAssembler(self.shard.limits.max_request_bytes, reserve=reserve)
            header = read_stream(request_iterator, assembler, "LoadState")
            values, slots = split_state(assembler.finish())
            if (values or slots) and not header.has_values:
                raise InvalidRequestError(
                    "LoadState carries values but its header says has_values=false"
                )
            self.shard.load_state(
                header.worker_id,
                header.digest,
                values if header.has_values else None,
                slots,
                timeout=_timeout(context),
            )
        return ps_pb2.LoadStateResponse()

    @rpc_errors
    def Status(self, request, context):
        st = self.shard.status()
        reply = ps_pb2.StatusResponse(
            initialized=st.initialized,
            clock=st.clock,
            total_bytes=st.total_bytes,
            pushes_applied=st.pushes_applied,
            pushes_duplicate=st.pushes_duplicate,
            pushes_late=st.pushes_late,
            live_workers=sorted(st.live),
            incarnation=self.shard.incarnation,
            checkpoint_step=st.checkpoint_step,
            checkpoint_age_s=st.checkpoint_age_s,
            left_workers=sorted(st.left),
            failure=st.failure,
            pending_workers=sorted(st.pending),
            joins=st.membership_counts.get("joined", 0) + st.membership_counts.get("rejoined", 0),
            leaves=st.membership_counts.get("left", 0),
            drops=st.membership_counts.get("dropped", 0) + st.membership_counts.get("replaced", 0),
            data_port=self.data_port,
        )
        for event, ago in st.history:
            reply.history.add(
                step=event.step,
                worker_id=event.worker,
                kind=event.kind,
                seconds_ago=ago,
                members=event.members,
            )
        if st.job is not None:
            reply.job.CopyFrom(job_to_proto(st.job))
        for worker, (clock, age) in st.workers.items():
            reply.workers.add(worker_id=worker, clock=clock, seconds_since_heartbeat=age)
        for name, (rows, nbytes, evictions, capacity) in st.tables.items():
            reply.tables.add(
                name=name, rows=rows, bytes=nbytes, evictions=evictions, capacity=capacity
            )
        return reply

    @rpc_errors
    def Checkpoint(self, request, context):
        if self.save_checkpoint is None:
            raise NotInitializedError(
                "this shard has no checkpoint directory (start psserver with --checkpoint-dir)"
            )
        path, step = self.save_checkpoint()
        return ps_pb2.CheckpointResponse(path=path, step=step)
