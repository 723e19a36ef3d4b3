"""One shard as a worker sees it: retries with backoff, restart detection, and push replay."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import grpc
import numpy as np

from pswire.codec import ChunkAssembler
from pswire.errors import UnavailableError
from pswire.optim import StepOptions
from pswire.proto import ps_pb2
from pswire.push import push_pull_request, push_stream
from pswire.rpc_errors import from_rpc_error
from pswire.stubs import ParameterServerStub
from pswire.tables import RowSparse
from psworker.stepstream import StepStream

T = TypeVar("T")
log = logging.getLogger(__name__)
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 2.0
# Unreachable, or (ABORTED) a shard other than the one this link last saw: re-register, retry.
_RECOVERABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


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
        worker_id: int,
        num_workers: int,
        timeout: float,
        retry_s: float,
        chunk_bytes: int,
    ) -> None:
        self.index = index
        self.address = address
        self.stub = ParameterServerStub(channel)
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.timeout = timeout
        self.retry_s = retry_s
        self.chunk_bytes = chunk_bytes
        self.incarnation: str | None = None
        self.checkpointing = False
        self.durable = 0
        self.log: dict[int, dict[str, np.ndarray | RowSparse]] = {}  # step -> pushed, for replay
        self.logged_options: dict[int, StepOptions] = {}  # step -> its options, for replay
        self.pull_skipped = False  # the last pull said: the step before it was skipped (sync)
        self.recoveries = 0
        self._rng = random.Random(worker_id * 7919 + index)
        # Small fused steps travel on one open call (see StepStream).
        self.steps = StepStream(self.stub, self.where("PushPullStream"))

    def where(self, rpc: str) -> str:
        return f"{rpc} on shard {self.index} ({self.address})"

    def call(self, rpc: str, fn: Callable[[ParameterServerStub], T]) -> T:
        """Runs ``fn(stub)``, retrying through UNAVAILABLE until ``retry_s`` is spent.

        Raises:
            PSError: the call failed for another reason, or the shard stayed unreachable.
        """
        deadline = time.monotonic() + self.retry_s
        attempt = 0
        while True:
            try:
                if attempt:
                    self._resync()
                return fn(self.stub)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in _RECOVERABLE or time.monotonic() >= deadline:
                    raise from_rpc_error(exc, self.where(rpc)) from None
                pause = min(backoff(attempt, self._rng), max(0.0, deadline - time.monotonic()))
                log.info("%s unavailable; retry %d in %.2fs", self.where(rpc), attempt + 1, pause)
                time.sleep(pause)
                attempt += 1

    def pull(
        self, request: ps_pb2.PullRequest, into: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """A Pull, decoded (into ``into``'s arrays where given).

        Raises:
            PSError: the call failed (after retries through UNAVAILABLE).
        """

        def run(stub: ParameterServerStub) -> dict[str, np.ndarray]:
            request.incarnation = self.incarnation or ""  # per attempt: a retry after a restart
            assembler = ChunkAssembler(into=into)
            self.pull_skipped = False
            for reply in stub.Pull(request, timeout=self.timeout):
                if reply.skipped:  # one last message, without a chunk
                    self.pull_skipped = True
                    continue
                assembler.add(reply.chunk)
            return assembler.finish()

        return self.call("Pull", run)

    def push(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        options: StepOptions | None = None,
    ) -> ps_pb2.PushResponse:
        """A streamed Push of this shard's pieces of one step (kept for replay first).

        Raises:
            PSError: the call failed (after retries through UNAVAILABLE).
        """
        self.note_push(step, pieces, options)
        reply = self.call(
            "Push",
            lambda stub: stub.Push(
                push_stream(
                    self.worker_id, step, pieces, self.chunk_bytes, self.incarnation, options
                ),
                timeout=self.timeout,
            ),
        )
        self.note_reply(reply.incarnation, reply.durable_step)
        return reply

    def push_pull(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        into: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
    ) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
        """One step as one message each way on the open step stream: the push, then the
        weights for the step after it (decoded into ``into``'s arrays where given).

        Raises:
            PSError: the call failed (after retries through UNAVAILABLE).
        """
        self.note_push(step, pieces, options)

        def run(_: ParameterServerStub) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
            # Built per attempt: a retry after a restart carries the new incarnation.
            fused = push_pull_request(self.worker_id, step, pieces, self.incarnation, options)
            reply = self.steps.step(fused, self.timeout)
            assembler = ChunkAssembler(into=into)
            for chunk in reply.chunks:
                assembler.add(chunk)
            return reply.push, assembler.finish()

        pushed, arrays = self.call("PushPull", run)
        self.note_reply(pushed.incarnation, pushed.durable_step)
        return pushed, arrays

    def register(self) -> ps_pb2.RegisterWorkerResponse:
        """RegisterWorker on this shard, remembering what it says about durability."""
        reply = self.stub.RegisterWorker(
            ps_pb2.RegisterWorkerRequest(worker_id=self.worker_id, num_workers=self.num_workers),
            timeout=self.timeout,
        )
        self.checkpointing = reply.checkpointing
        self.durable = reply.durable_step
        return reply

    def note_push(
        self,
        step: int,
        pieces: Mapping[str, np.ndarray | RowSparse],
        options: StepOptions | None = None,
    ) -> None:
        """Keeps a copy of a push until a checkpoint covers it (only if the shard checkpoints)."""
        if self.checkpointing and options is not None:
            self.logged_options[step] = options
        if self.checkpointing:
            self.log[step] = {
                k: RowSparse(v.ids.copy(), v.values.copy())
                if isinstance(v, RowSparse)
                else np.array(v, copy=True)
                for k, v in pieces.items()
            }

    def note_reply(self, incarnation: str, durable_step: int) -> None:
        """Forgets pushes the shard's newest checkpoint holds."""
        if self.incarnation is None:
            self.incarnation = incarnation
        self.durable = max(self.durable, durable_step)
        for step in [s for s in self.log if s < self.durable]:
            del self.log[step]
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
            raise UnavailableError(
                f"shard {self.index} ({self.address}) restarted without a checkpoint, so its "
                "variables are gone; run psserver with --checkpoint-dir to survive restarts"
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
            self.stub.Push(
                push_stream(
                    self.worker_id,
                    step,
                    self.log[step],
                    self.chunk_bytes,
                    reply.incarnation,
                    self.logged_options.get(step),
                ),
                timeout=self.timeout,
            )
        self.incarnation = reply.incarnation
        self.recoveries += 1
