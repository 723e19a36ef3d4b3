"""gRPC servicer for a shard: decode the request, call ``Shard``, encode the reply."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import grpc
import numpy as np

from psserver.job import Job, VarSpec
from psserver.metrics import ShardMetrics
from psserver.shard import Shard
from pswire.codec import DEFAULT_CHUNK_BYTES, ChunkAssembler, tensor_nbytes, tensor_to_proto
from pswire.errors import InvalidRequestError, NotInitializedError, PSError
from pswire.optim import optimizer_from_spec
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.status import rpc_errors
from pswire.tables import RowSparse, table_from_proto, table_to_proto
from pswire.wiremsg import encode_chunk_messages, varint_field

# Finish a server-side wait this long before the caller's deadline, so the caller gets our
# specific error (what the wait was for) rather than a bare DEADLINE_EXCEEDED.
DEADLINE_MARGIN_S = 0.25


def job_from_proto(spec: ps_pb2.JobSpec) -> Job:
    """Builds a Job from the wire, validating dtypes and dims.

    Raises:
        InvalidRequestError: bad optimizer, dtype or dims.
    """
    variables = []
    for v in spec.variables:
        # The same dtype and dims checks as a tensor on the wire: a job must not declare a
        # variable that no tensor could ever match (negative or absurd dims).
        tensor_nbytes(v.name, v.dtype, v.shape)
        table = table_from_proto(v) if v.HasField("table") else None
        shape = tuple(int(d) for d in v.shape)
        variables.append(VarSpec(v.name, shape, v.dtype, v.average, table))
    return Job(
        mode=spec.mode,
        staleness=int(spec.staleness),
        num_workers=int(spec.num_workers),
        optimizer=optimizer_from_spec(spec.optimizer.name, dict(spec.optimizer.params)),
        variables=tuple(variables),
        model_digest=spec.model_digest,
        quorum=int(spec.quorum),
    )


def job_to_proto(job: Job) -> ps_pb2.JobSpec:
    return ps_pb2.JobSpec(
        mode=job.mode,
        staleness=job.staleness,
        num_workers=job.num_workers,
        optimizer=ps_pb2.OptimizerSpec(name=job.optimizer.name, params=job.optimizer.params()),
        variables=[variable_to_proto(v) for v in job.variables],
        model_digest=job.model_digest,
        quorum=job.quorum,
    )


def variable_to_proto(v: VarSpec) -> ps_pb2.VariableSpec:
    if v.table is not None:
        return table_to_proto(v.table)
    return ps_pb2.VariableSpec(name=v.key, dtype=v.dtype, shape=v.shape, average=v.average)


def _row_query(request: ps_pb2.PullRequest) -> list[tuple[str, np.ndarray]]:
    """(table, ids) pairs of a pull; ids decoded without a copy.

    Raises:
        InvalidRequestError: ids that are not whole int64s.
    """
    rows = []
    for q in request.rows:
        if len(q.ids) % 8:
            raise InvalidRequestError(
                f"table '{q.table}': row ids are {len(q.ids)} bytes, not a whole number of int64s"
            )
        rows.append((q.table, np.frombuffer(q.ids, dtype="<i8")))
    return rows


def _timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)


class _Reply(list):
    """A pull reply's messages; a list that can be weakly referenced, keyed by what it holds."""

    key: tuple = ()


def _none() -> None:
    return None


def _until_gone(requests: Iterable[Any]) -> Iterator[Any]:
    """The requests of a stream, ending quietly when the client cancels or goes away (grpc
    raises RpcError from the iterator then: there is no one left to answer)."""
    iterator = iter(requests)
    while True:
        try:
            yield next(iterator)
        except (StopIteration, grpc.RpcError):
            return


def _header_then_chunks(
    requests: Iterable, header_field: str, assembler: ChunkAssembler, rpc: str
) -> object:
    """Reads a header-then-chunks stream; returns the header, chunks fed to ``assembler``."""
    header = None
    for req in requests:
        kind = req.WhichOneof("body")
        if kind == "header":
            if header is not None:
                raise InvalidRequestError(f"{rpc} stream carries a second header")
            header = getattr(req, header_field)
        elif kind == "chunk":
            if header is None:
                raise InvalidRequestError(f"{rpc} stream sends a chunk before its header")
            assembler.add(req.chunk)
        else:
            raise InvalidRequestError(f"{rpc} stream carries an empty message")
    if header is None:
        raise InvalidRequestError(f"{rpc} stream ended without a header")
    return header


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Thin adapter from the ParameterServer service onto one ``Shard``."""

    def __init__(
        self,
        shard: Shard,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checkpoint: Callable[[], tuple[str, int]] | None = None,
        metrics: ShardMetrics | None = None,
    ) -> None:
        self.shard = shard
        self.chunk_bytes = chunk_bytes
        self.save_checkpoint = checkpoint
        self.metrics = metrics
        shard.checkpointing = checkpoint is not None
        self._shared_pull: Callable[[], _Reply | None] = _none  # see _encode_pull

    def _waiting(self, rpc: str) -> AbstractContextManager[None]:
        return self.metrics.waiting(rpc) if self.metrics is not None else nullcontext()

    @rpc_errors
    def RegisterWorker(self, request, context):
        reg = self.shard.register_worker(request.worker_id, request.num_workers)
        return ps_pb2.RegisterWorkerResponse(
            clock=reg.clock,
            initialized=reg.initialized,
            incarnation=self.shard.incarnation,
            durable_step=reg.durable_step,
            checkpointing=self.shard.checkpointing,
        )

    @rpc_errors
    def Heartbeat(self, request, context):
        return ps_pb2.HeartbeatResponse(clock=self.shard.heartbeat(request.worker_id))

    @rpc_errors
    def Init(self, request_iterator, context):
        assembler = ChunkAssembler(self.shard.limits.max_request_bytes)
        header = _header_then_chunks(request_iterator, "header", assembler, "Init")
        assert isinstance(header, ps_pb2.InitHeader)
        values: dict | None = assembler.finish()
        if assembler.indices:
            raise InvalidRequestError(
                f"Init carries row ids for {sorted(assembler.indices)}: tables are never sent"
            )
        if values and not header.has_values:
            raise InvalidRequestError("Init carries values but its header says has_values=false")
        if not header.has_values:
            values = None
        job = job_from_proto(header.job)
        # The assembler's arrays belong to this call alone: the shard may keep them.
        accepted = self.shard.init(header.worker_id, job, values, take=True)
        return ps_pb2.InitResponse(values_accepted=accepted)

    def _encode_pull(self, arrays: Mapping[str, np.ndarray], clock: int) -> list[bytes]:
        """The PullResponse messages of a snapshot; runs under the shard's lock (the encoded
        reply is the snapshot: one copy).

        Pulls of the same variables at the same clock share one encoded reply while any of
        them is still sending it: in sync mode every worker pulls as a step closes, and each
        reply is a whole copy of the shard's variables. (The clock moves with every update;
        values change no other way while the shard serves.)
        """
        if self.metrics is not None:
            self.metrics.count_pull(arrays)
        key = (clock, tuple(arrays))
        shared = self._shared_pull()
        if shared is not None and shared.key == key:
            return shared
        reply = self._messages(arrays, clock)
        reply.key = key
        self._shared_pull = weakref.ref(reply)
        return reply

    def _encode_rows_pull(self, arrays: Mapping[str, np.ndarray], clock: int) -> list[bytes]:
        """As ``_encode_pull``, for a pull with table rows: its own reply, never shared."""
        if self.metrics is not None:
            self.metrics.count_pull(arrays)
        return self._messages(arrays, clock)

    def _messages(self, arrays: Mapping[str, np.ndarray], clock: int) -> _Reply:
        trailer = varint_field(2, clock)  # PullResponse.clock, after the chunk (field 1)
        return _Reply(
            message
            for name, array in arrays.items()
            for message in encode_chunk_messages(name, array, 1, self.chunk_bytes, trailer=trailer)
        )

    @rpc_errors
    def Pull(self, request, context):
        rows = _row_query(request)
        with self._waiting("Pull"):
            messages, _ = self.shard.pull(
                request.worker_id,
                request.step,
                list(request.names),
                timeout=_timeout(context),
                encode=self._encode_rows_pull if rows else self._encode_pull,
                rows=rows,
                incarnation=request.incarnation,
            )
        yield from messages

    def _push(
        self, header: ps_pb2.PushHeader, assembler: ChunkAssembler, timeout: float | None
    ) -> ps_pb2.PushResponse:
        """Applies one decoded push (as the consistency rule says); its reply."""
        rows = assembler.indices
        grads = {
            k: RowSparse(rows[k], a) if k in rows else a for k, a in assembler.finish().items()
        }
        if self.metrics is not None:
            self.metrics.count_push(grads)
        with self._waiting("Push"):
            result = self.shard.push(
                header.worker_id,
                header.step,
                grads,
                timeout=timeout,
                incarnation=header.incarnation,
                take=True,  # the assembler's arrays belong to this call alone
            )
        return ps_pb2.PushResponse(
            applied=result.applied,
            reason=result.reason,
            clock=result.clock,
            incarnation=self.shard.incarnation,
            durable_step=result.durable_step,
        )

    @rpc_errors
    def Push(self, request_iterator, context):
        assembler = ChunkAssembler(self.shard.limits.max_request_bytes)
        header = _header_then_chunks(request_iterator, "header", assembler, "Push")
        assert isinstance(header, ps_pb2.PushHeader)
        return self._push(header, assembler, _timeout(context))

    @rpc_errors
    def PushPull(self, request, context):
        return self._push_pull(request, _timeout(context))

    @rpc_errors
    def PushPullStream(self, request_iterator, context):
        for request in _until_gone(request_iterator):
            # Each step's own deadline, within the call's.
            timeout = request.timeout_ms / 1000 if request.timeout_ms else None
            remaining = _timeout(context)
            if remaining is not None:
                timeout = remaining if timeout is None else min(timeout, remaining)
            if self.metrics is None:
                yield self._push_pull(request, timeout)
                continue
            # Each step is timed and counted as a PushPull, as if it were its own call.
            start = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                reply = self._push_pull(request, timeout)
                code = grpc.StatusCode.OK
            except PSError as exc:
                code = grpc.StatusCode[exc.status]
                raise
            finally:
                self.metrics.observe_rpc("PushPull", code, time.perf_counter() - start)
            yield reply

    def _push_pull(
        self, request: ps_pb2.PushPullRequest, timeout: float | None
    ) -> ps_pb2.PushPullResponse:
        assembler = ChunkAssembler(self.shard.limits.max_request_bytes)
        for chunk in request.chunks:
            assembler.add(chunk)
        pushed = self._push(request.header, assembler, timeout)
        # The weights for the next step, as a Pull at step + 1 would read them (after a late
        # sync push: the step the shard is in, which the client then moves on to).
        step = request.header.step + 1
        if pushed.reason == "late":
            step = max(step, pushed.clock)

        def encode(arrays: Mapping[str, np.ndarray], clock: int) -> list[ps_pb2.TensorChunk]:
            # Under the shard's lock: the chunks' bytes are the snapshot (one copy).
            if self.metrics is not None:
                self.metrics.count_pull(arrays)
            return [tensor_to_proto(key, array) for key, array in arrays.items()]

        with self._waiting("Pull"):
            chunks, clock = self.shard.pull(
                request.header.worker_id,
                step,
                timeout=timeout,
                encode=encode,
                incarnation=request.header.incarnation,
            )
        return ps_pb2.PushPullResponse(push=pushed, chunks=chunks, clock=clock)

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
