"""A shard: its variables, their optimizer state, worker clocks and the consistency rule.

Plain Python: no grpc here. The servicer decodes requests into calls on ``Shard`` and encodes
what comes back; every error is a ``PSError`` whose status the servicer sends.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from psserver.consistency import Clocks, ConsistencyPolicy, make_policy
from psserver.membership import Membership
from psserver.observer import Observer, observed
from psserver.records import Limits, PushResult, Registration, ShardState, ShardStatus
from psserver.shard_optim import NO_OPTIONS, OptimizerSide, StepOptions
from psserver.variables import Variables
from pswire.errors import (
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    ShardRestartedError,
    TooLargeError,
    WaitTimeoutError,
)
from pswire.job import OBSERVER, Job
from pswire.tables import RowSparse


class Shard(OptimizerSide):
    """One parameter-server shard; thread-safe, every wait bounded."""

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or Limits()
        self.incarnation = uuid.uuid4().hex[:12]
        self.checkpointing = False  # set by the CheckpointScheduler that saves this shard
        self.observer: Observer | None = None  # set by the server when metrics are on
        self._now = clock
        self._cond = threading.Condition()
        self._job: Job | None = None
        self._policy: ConsistencyPolicy | None = None
        self._state = Variables()
        self._finished: dict[int, int] = {}
        self._members = Membership(self.limits.heartbeat_timeout_s)
        self._ready = False  # initial values installed
        self._updates = 0
        self._counters = {"applied": 0, "duplicate": 0, "late": 0}
        self._durable: dict[int, int] = {}  # worker -> its steps in the newest checkpoint
        self._checkpoint_step = -1
        self._checkpoint_time: float | None = None
        self._start_optimizer_side(None)

    def register_worker(self, worker_id: int, num_workers: int) -> Registration:
        """Records a worker (new, restarted or reconnecting); says where it (re)joins.

        Raises:
            InvalidRequestError: ids out of range.
            TooLargeError: more workers than the shard's limit.
            ModelMismatchError: ``num_workers`` differs from the job's.
        """
        if num_workers < 1 or not 0 <= worker_id < num_workers:
            raise InvalidRequestError(
                f"worker_id {worker_id} must be in [0, num_workers) with num_workers >= 1, "
                f"got num_workers {num_workers}"
            )
        if num_workers > self.limits.max_workers:
            raise TooLargeError(
                f"num_workers {num_workers} is over this shard's limit of {self.limits.max_workers}"
            )
        with self._cond:
            if self._job is not None and self._job.num_workers != num_workers:
                raise ModelMismatchError(
                    f"worker {worker_id} says num_workers {num_workers}; the job on this shard "
                    f"has {self._job.num_workers}"
                )
            self._touch(worker_id)
            if self._policy is not None:
                # A worker that fell behind (dropped, restarted) resumes at the current step.
                joined = self._policy.join_clock(self._clocks(), worker_id)
                self._finished[worker_id] = max(self._finished.get(worker_id, 0), joined)
            return Registration(
                self._finished.get(worker_id, 0), self._ready, self._durable.get(worker_id, 0)
            )

    def heartbeat(self, worker_id: int) -> int:
        """Marks a worker alive; returns the steps it has finished here.

        Raises:
            InvalidRequestError: an id outside the job's workers (before a job: the limit).
        """
        with self._cond:
            job = self._job
            self._check_worker(
                worker_id, job.num_workers if job else self.limits.max_workers, "heartbeat"
            )
            self._touch(worker_id)
            return self._finished.get(worker_id, 0)

    def init(
        self,
        worker_id: int,
        job: Job,
        values: Mapping[str, np.ndarray] | None,
        take: bool = False,
    ) -> bool:
        """Agrees on the job; installs initial values if none are held yet.

        Returns whether ``values`` were installed (False when the shard already had values:
        a restarted or later worker never overwrites trained weights). ``take``: the caller
        hands the arrays over (nothing else refers to them), so writable ones of the right
        dtype are kept as they are instead of copied.

        Raises:
            InvalidRequestError: bad job description or values.
            ModelMismatchError: the job differs from the one the shard holds.
            TooLargeError: more variables than the shard's limit.
        """
        job.check(self.limits.max_workers, self.limits.max_variables)
        self._check_worker(worker_id, job.num_workers, "init")
        if values is not None:
            job.check_values(values)
        with self._cond:
            if self._job is None:
                self._set_job(job)
            else:
                diffs = job.differences(self._job)
                if diffs:
                    raise ModelMismatchError(
                        f"worker {worker_id}'s job differs from the one this shard holds: "
                        + "; ".join(diffs[:10])
                    )
            self._touch(worker_id)
            self._forget_load(worker_id)
            if values is None or self._ready:
                return False
            self._state.install(job, values, take)
            self._ready = True
            self._cond.notify_all()
            return True

    def _set_job(self, job: Job) -> None:
        self._job = job
        self._policy = make_policy(job.mode, job.staleness, job.quorum)
        self._members.start(job.num_workers, self._now())
        self._start_optimizer_side(job)

    def pull(
        self,
        worker_id: int,
        step: int,
        names: Sequence[str] = (),
        timeout: float | None = None,
        encode: Callable[[Mapping[str, np.ndarray], int], Any] | None = None,
        rows: Sequence[tuple[str, np.ndarray]] = (),
        incarnation: str = "",
    ) -> tuple[Any, int]:
        """Snapshot of the variables once the consistency rule lets a worker at ``step`` read.

        ``rows``: (table, ids) pairs; each table's rows come back under its name, in id order
        (a dynamic table makes rows on first touch). Empty ``names`` means every variable
        that is not a table, or none when ``rows`` are asked for.

        Returns (copies of the variables, the clock). With ``encode``, returns
        ``encode(variables, clock)`` instead, called with the live arrays under the shard's lock:
        whatever it builds from them (the reply's bytes) is the snapshot, with no second copy.
        ``encode`` must not keep the arrays. ``worker_id`` ``OBSERVER`` (-1) reads without
        counting as any worker (psctl export).

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError: a worker id outside the job, or a negative step.
            UnknownVariableError: a name the shard does not hold.
            WaitTimeoutError: the rule or the initial values did not allow reading in time.
        """
        with observed(self.observer, "Pull"):
            return self._pull(worker_id, step, names, timeout, encode, rows, incarnation)

    def _pull(
        self,
        worker_id: int,
        step: int,
        names: Sequence[str],
        timeout: float | None,
        encode: Callable[[Mapping[str, np.ndarray], int], Any] | None,
        rows: Sequence[tuple[str, np.ndarray]],
        incarnation: str,
    ) -> tuple[Any, int]:
        self._check_incarnation(incarnation, worker_id, "pull")
        job = self._require_job()
        if worker_id != OBSERVER:
            self._check_worker(worker_id, job.num_workers, "pull")
        if step < 0:
            raise InvalidRequestError(f"pull by worker {worker_id} has negative step {step}")
        keys = job.pull_keys(names, rows)
        with self._cond:
            self._touch(worker_id)
            self._wait_values(timeout)
            policy = self._require_policy()
            self._wait(
                lambda: policy.read_ready(self._clocks(), step),
                timeout,
                lambda: f"pull by worker {worker_id}: " + policy.waiting_for(self._clocks(), step),
            )
            # Gathering copies the rows: they are this pull's snapshot either way.
            gathered = {table: self._state.tables[table].gather(ids) for table, ids in rows}
            arrays = {**{k: self._state.values[k] for k in keys}, **gathered}
            if self.observer is not None:
                self.observer.pulled(arrays)
            if encode is not None:
                return encode(arrays, self._updates), self._updates
            return {k: a if k in gathered else a.copy() for k, a in arrays.items()}, self._updates

    def push(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray | RowSparse],
        timeout: float | None = None,
        incarnation: str = "",
        take: bool = False,
        options: StepOptions = NO_OPTIONS,
    ) -> PushResult:
        """Takes one worker's gradients (and ``options``) for one step, as the rule says.

        ``take``: the arrays were decoded for this call alone and may be changed (the
        servicer's); sync mode then sums a step's pushes into one of them instead of a copy.

        A push is applied at most once per (worker, step): a duplicate is acknowledged with
        ``applied=False, reason="duplicate"``; in ``sync`` a push for a step that already
        closed without it is dropped with ``reason="late"`` (and counted). Nothing changes
        unless every gradient is valid.

        Gradients of float32 variables may arrive as float16 or bfloat16 (the client's wire
        compression); they are widened to float32 before anything else.

        Raises:
            NotInitializedError: no job yet.
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: bad gradients/options.
            HyperParameterMismatchError: sync, and another push of the step had other values.
            WaitTimeoutError: the rule did not let the push in within the deadline.
        """
        with observed(self.observer, "Push", grads):
            return self._push(worker_id, step, grads, timeout, incarnation, take, options)

    def _push(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray | RowSparse],
        timeout: float | None,
        incarnation: str,
        take: bool,
        options: StepOptions,
    ) -> PushResult:
        self._check_incarnation(incarnation, worker_id, "push")
        job = self._require_job()
        if not 0 <= worker_id < job.num_workers:
            raise InvalidRequestError(
                f"push from worker {worker_id}, but the job has workers 0..{job.num_workers - 1}"
            )
        if step < 0:
            raise InvalidRequestError(f"push from worker {worker_id} has negative step {step}")
        grads = job.checked_grads(grads)
        optimizers = job.step_optimizers(options)
        with self._cond:
            self._touch(worker_id)
            self._wait_values(timeout)
            policy = self._require_policy()
            skipped = self._skip(policy, worker_id, step)
            if skipped is not None:
                return skipped
            self._wait(
                lambda: policy.push_ready(self._clocks(), worker_id, step),
                timeout,
                lambda: f"push by worker {worker_id}: " + policy.waiting_for(self._clocks(), step),
            )
            # The wait released the lock: a retry of this push may have landed meanwhile.
            skipped = self._skip(policy, worker_id, step)
            if skipped is not None:
                return skipped
            self._steps.take(worker_id, step, optimizers, options.skip)
            update = policy.submit(self._clocks(), worker_id, step, grads, owned=take)
            self._finished[worker_id] = max(self._finished.get(worker_id, 0), step + 1)
            self._counters["applied"] += 1
            if update is not None:
                self._apply(update)
            self._cond.notify_all()
            return self._result(True, "", worker_id, step)

    def push_pull(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray | RowSparse],
        encode: Callable[[Mapping[str, np.ndarray], int], Any],
        timeout: float | None = None,
        incarnation: str = "",
        take: bool = False,
        options: StepOptions = NO_OPTIONS,
    ) -> tuple[PushResult, Any, int]:
        """``push``, then ``pull`` of every variable that is not a table at the step the
        worker goes on to (``PushResult.next_step``): (the push's result, ``encode``'s
        snapshot, the clock it was read at).

        Raises:
            as ``push`` and ``pull``.
        """
        result = self.push(worker_id, step, grads, timeout, incarnation, take, options)
        snapshot, clock = self.pull(
            worker_id, result.next_step, timeout=timeout, encode=encode, incarnation=incarnation
        )
        result.skipped = options.skip or self.step_skipped(step)
        return result, snapshot, clock

    def _skip(self, policy: ConsistencyPolicy, worker_id: int, step: int) -> PushResult | None:
        reason = policy.classify(self._clocks(), worker_id, step)
        if reason is None:
            return None
        self._counters[reason] += 1
        return self._result(False, reason, worker_id, step)

    def _result(self, applied: bool, reason: str, worker_id: int, step: int) -> PushResult:
        # After a late sync push the worker moves on to the step the shard is in.
        after = max(step + 1, self._updates) if reason == "late" else step + 1
        return PushResult(applied, reason, self._updates, self._durable.get(worker_id, 0), after)

    def _apply(self, update: Mapping[str, Any]) -> None:
        optimizers, skip = self._steps.pop(self._updates)
        self._state.apply(self._require_job(), update, optimizers, skip)
        self._updates += 1

    def status(self) -> ShardStatus:
        with self._cond:
            now = self._now()
            self._expire()
            workers = {
                w: (self._finished.get(w, 0), self._members.seconds_since(w, now))
                for w in self._members.known()
            }
            age = -1.0 if self._checkpoint_time is None else now - self._checkpoint_time
            return ShardStatus(
                initialized=self._ready,
                job=self._job,
                clock=self._updates,
                workers=workers,
                live=self._members.live,
                total_bytes=self._state.nbytes,
                pushes_applied=self._counters["applied"],
                pushes_duplicate=self._counters["duplicate"],
                pushes_late=self._counters["late"],
                checkpoint_step=self._checkpoint_step,
                checkpoint_age_s=age,
                tables={
                    k: (t.rows, t.nbytes, t.evictions, t.spec.capacity)
                    for k, t in self._state.tables.items()
                },
            )

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every variable (for tests and exports)."""
        with self._cond:
            return {k: v.copy() for k, v in self._state.values.items()}

    def export_state(self) -> ShardState | None:
        """A consistent copy of everything a checkpoint needs; None before initial values.

        Taken between updates, so a sync step is either wholly in it or not at all: pushes to
        the open step are left out (their workers' clocks say so) and get re-sent by the
        workers after a restart.
        """
        with self._cond:
            if not self._ready:
                return None
            assert self._job is not None
            policy = self._require_policy()
            finished = {
                w: policy.durable_clock(self._updates, f) for w, f in self._finished.items()
            }
            variables, slots, tables = self._state.export()
            return ShardState(
                job=self._job,
                variables=variables,
                slots=slots,
                updates=self._updates,
                finished=finished,
                counters=dict(self._counters),
                tables=tables,
            )

    def mark_checkpoint(self, state: ShardState) -> None:
        """Records that ``state`` is durable: workers may forget pushes it covers."""
        with self._cond:
            self._durable = dict(state.finished)
            self._checkpoint_step = state.updates
            self._checkpoint_time = self._now()

    def restore(self, state: ShardState) -> None:
        """Becomes the shard that saved ``state`` (on a fresh shard, before serving).

        Raises:
            InvalidRequestError: the state does not match its own job.
        """
        restored = Variables.restored(state.job, state.variables, state.slots, state.tables)
        with self._cond:
            self._set_job(state.job)
            self._state = restored
            self._updates = state.updates
            self._finished = dict(state.finished)
            self._counters.update(state.counters)
            self._ready = True
            self._cond.notify_all()
        self.mark_checkpoint(state)

    def _clocks(self) -> Clocks:
        # The live dict, not a copy: policies only read it, under the lock, and keep nothing.
        return Clocks(self._updates, self._finished, self._members.live_view)

    def _touch(self, worker_id: int) -> None:
        if worker_id == OBSERVER:
            return  # a reader such as psctl export is no worker: it must not join the quorum
        if self._members.touch(worker_id, self._now()):
            self._cond.notify_all()

    def _expire(self) -> None:
        """Drops silent workers; a sync step waiting only on them closes now."""
        if self._policy is None or not self._members.expire(self._now()):
            return
        update = self._policy.membership_changed(self._clocks())
        if update is not None:
            self._apply(update)
        self._cond.notify_all()

    def _check_incarnation(self, seen: str, worker_id: int, what: str) -> None:
        """Refuses a call made for an earlier incarnation of this shard (before a restart):
        the worker must re-register and replay what the restart lost, not carry on.

        Raises:
            ShardRestartedError: ``seen`` is set and is not this shard's incarnation.
        """
        if seen and seen != self.incarnation:
            raise ShardRestartedError(
                f"{what} by worker {worker_id} was made for shard incarnation {seen}, but the "
                f"shard restarted (now {self.incarnation}): re-register and replay first"
            )

    def _require_job(self) -> Job:
        job = self._job
        if job is None:
            raise NotInitializedError(
                "this shard holds no job yet: a worker must call init before pull or push"
            )
        return job

    def _check_worker(self, worker_id: int, num_workers: int, what: str) -> None:
        # Checked before any bookkeeping: an unknown id recorded as a member would join the
        # quorum, and a sync step would wait for a worker that does not exist.
        if not 0 <= worker_id < num_workers:
            raise InvalidRequestError(
                f"{what} from worker {worker_id}, but worker ids are 0..{num_workers - 1}"
            )

    def _require_policy(self) -> ConsistencyPolicy:
        assert self._policy is not None
        return self._policy

    def _wait_values(self, timeout: float | None) -> None:
        self._wait(
            lambda: self._ready,
            timeout,
            lambda: "initial values from the initialising worker (worker 0) never arrived",
        )

    def _wait(
        self, ready: Callable[[], bool], timeout: float | None, describe: Callable[[], str]
    ) -> None:
        """Waits (lock held) until ``ready()``, dropping silent workers meanwhile.

        Raises:
            WaitTimeoutError: not ready within the deadline; the message says what was missing.
        """
        if ready():
            return
        limit = self.limits.max_wait_s if timeout is None else min(timeout, self.limits.max_wait_s)
        deadline = time.monotonic() + max(0.0, limit)
        # Wake up often enough to notice a worker passing its heartbeat timeout.
        hb = self.limits.heartbeat_timeout_s
        tick = min(1.0, hb / 4) if hb > 0 else 1.0
        while not ready():
            self._expire()
            if ready():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(f"gave up after {limit:.1f}s waiting for {describe()}")
            self._cond.wait(min(remaining, tick))
