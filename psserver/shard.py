"""A shard: one job's agreement, worker clocks and membership, the consistency rule, and the
waits they impose, over the model state in ``variables.py``.

Plain Python: no grpc here. The servicer decodes requests into calls on ``Shard`` and encodes
what comes back; every error is a ``PSError`` whose status the servicer sends.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pscore.job import OBSERVER, Job
from pscore.tables import RowSparse
from pscore.variables import Variables
from psserver.agreement import JobAgreement
from psserver.consistency import Clocks, ConsistencyPolicy, make_policy
from psserver.elastic import Joins
from psserver.history import MembershipHistory
from psserver.membership import Membership
from psserver.observer import Observer, observed
from psserver.records import Limits, PushResult
from psserver.reports import Reports
from psserver.roster import Roster
from psserver.shard_optim import NO_OPTIONS, OptimizerSide, StepOptions
from pswire.errors import (
    CallCancelledError,
    InvalidRequestError,
    NotInitializedError,
    ShardRestartedError,
    StepRefusedError,
    UnavailableError,
    WaitTimeoutError,
)

# No step is ever this large: a clock past it would overflow the wire's int64.
MAX_STEP = 1 << 62


class Shard(Roster, Joins, Reports, OptimizerSide):
    """One parameter-server shard; thread-safe, every wait bounded.

    ``clock`` (seconds, monotonic) is what membership reads: tests inject one and call
    ``expire_silent`` to drop workers without sleeping.
    """

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or Limits()
        self.incarnation = uuid.uuid4().hex[:12]
        self.checkpointing = False  # set by the CheckpointScheduler that saves this shard
        self.observer: Observer | None = None  # set by the server when metrics are on
        self._now = clock
        self._cond = threading.Condition()
        self._agreement = JobAgreement()
        self._policy: ConsistencyPolicy | None = None
        self._state = Variables()
        self._finished: dict[int, int] = {}
        self._members = Membership(self.limits.heartbeat_timeout_s, self.limits.claim_grace_s)
        self._history = MembershipHistory()
        self._opened = -1  # the newest step read or pushed at
        self._ready = False  # initial values installed
        self._updates = 0
        self._counters = {"applied": 0, "duplicate": 0, "late": 0}
        self._durable: dict[int, int] = {}  # worker -> its steps in the newest checkpoint
        self._checkpoint_step = -1
        self._checkpoint_time: float | None = None
        self._failure = ""  # a refused sync step: every later step fails with it
        self._closed = False
        self._start_optimizer_side(None)

    @property
    def _job(self) -> Job | None:
        return self._agreement.job

    @property
    def job_id(self) -> str:
        """The id of the job this shard holds ("" before any)."""
        job = self._agreement.job
        return job.job_id if job is not None else ""

    def close(self) -> None:
        """The shard is stopping: every wait ends now, and new calls that would wait fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes every wait to look again (a call was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def init(
        self,
        worker_id: int,
        job: Job,
        values: Mapping[str, np.ndarray] | None,
        take: bool = False,
    ) -> bool:
        """Agrees on the job (worker 0's: see ``JobAgreement``); installs initial values if none
        are held yet. Returns whether ``values`` were installed (``job_id`` says which job the
        shard holds now).

        Values are not installed when the shard already has some: a restarted or later worker
        never overwrites trained weights. ``take``: the caller hands the arrays over (nothing
        else refers to them), so writable ones of the right dtype are kept as they are.

        Raises:
            InvalidRequestError: bad job description or values.
            ModelMismatchError: the job differs from worker 0's, which the shard holds.
            TooLargeError: over the shard's limits (variables, memory).
        """
        limits = self.limits
        job.check(limits.max_workers, limits.max_variables, limits.memory_limit_bytes)
        self._check_worker(worker_id, job.num_workers, "init")
        if values is not None:
            job.check_values(values)
        # Tables are made (and their rows drawn) outside the lock: a large one takes seconds,
        # and status and health must not wait for it.
        if values is not None and worker_id != 0:
            raise InvalidRequestError(
                f"init from worker {worker_id} carries initial values: only worker 0 sends them"
            )
        state = Variables()
        if values is not None and not self._ready:  # unlocked peek: a waste at worst
            state.install(job, values, take)
        with self._cond:
            if self._agreement.declare(worker_id, job):
                self._set_job(job)
            self._touch(worker_id)
            self._forget_load(worker_id)
            if values is None or self._ready:
                return False
            self._state = state
            self._ready = True
            self._cond.notify_all()
            return True

    def _set_job(self, job: Job) -> None:
        self._policy = make_policy(job.mode, job.staleness, job.quorum)
        self._members.start(job.num_workers, self._now(), job.elastic, None, job.min_workers)
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
        cancelled: threading.Event | None = None,
    ) -> tuple[Any, int]:
        """Snapshot of the variables once the consistency rule lets a worker at ``step`` read.

        ``rows``: (table, ids) pairs; each table's rows come back under its name, in id order
        (a dynamic table makes rows on first touch). Empty ``names`` means every variable
        that is not a table, or none when ``rows`` are asked for.

        Returns (copies of the variables, the clock). With ``encode``, returns
        ``encode(variables, clock)`` instead, called with the live arrays under the shard's lock:
        whatever it builds from them (the reply's bytes) is the snapshot, with no second copy.
        ``encode`` must not keep the arrays. ``worker_id`` ``OBSERVER`` (-1) reads without
        counting as any worker (psctl export). ``cancelled`` set (and ``wake`` called) ends
        the wait: the caller has gone.

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError: a worker id outside the job, or a step out of range.
            UnknownVariableError: a name the shard does not hold.
            ModelMismatchError: this worker declared another job than worker 0's.
            WaitTimeoutError: the rule or the initial values did not allow reading in time.
            StepRefusedError: the shard refused a step it could not apply.
            UnavailableError, CallCancelledError: the shard is stopping; the caller went away.
        """
        with observed(self.observer, "Pull"):
            job = self._check_call(worker_id, step, incarnation, "pull", reader=True)
            keys = job.pull_keys(names, rows)
            with self._cond:
                self._touch(worker_id)
                self._wait_agreed(worker_id, timeout, cancelled)
                policy = self._require_policy()
                self._wait(
                    lambda: (
                        policy.read_ready(self._clocks(), step)
                        and policy.admits(self._clocks(), step)
                    ),
                    timeout,
                    cancelled,
                    lambda: f"pull by worker {worker_id}: " + self._waiting_for(policy, step),
                )
                if worker_id != OBSERVER:
                    self._open(step)
                # Gathering copies the rows: they are this pull's snapshot either way.
                gathered = {table: self._state.tables[table].gather(ids) for table, ids in rows}
                arrays = {**{k: self._state.values[k] for k in keys}, **gathered}
                if self.observer is not None:
                    self.observer.pulled(arrays)
                if encode is not None:
                    return encode(arrays, self._updates), self._updates
                snapshot = {k: a if k in gathered else a.copy() for k, a in arrays.items()}
                return snapshot, self._updates

    def push(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray | RowSparse],
        timeout: float | None = None,
        incarnation: str = "",
        take: bool = False,
        session: str = "",
        cancelled: threading.Event | None = None,
        options: StepOptions = NO_OPTIONS,
    ) -> PushResult:
        """Takes one worker's gradients (and ``options``) for one step, as the rule says.

        ``take``: the arrays were decoded for this call alone and may be changed (the
        servicer's); sync mode then sums a step's pushes into one of them instead of a copy.

        A push is applied at most once per (worker, step): a duplicate is acknowledged with
        ``applied=False, reason="duplicate"``; in ``sync`` a push for a step that already
        closed without it is dropped with ``reason="late"`` (and counted). A step may be at
        most ``limits.max_step_ahead`` beyond the one the shard expects from this worker.
        Nothing changes unless every gradient is valid, and no step whose result would not
        be finite is applied.

        Gradients of float32 variables may arrive as float16 or bfloat16 (the client's wire
        compression); they are widened to float32 before anything else.

        Raises:
            NotInitializedError: no job yet.
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: bad gradients, step
                or options.
            ModelMismatchError: this worker declared another job than worker 0's.
            HyperParameterMismatchError: sync, and another push of the step had other values.
            DuplicateWorkerError: another process holds this worker id now.
            WaitTimeoutError: the rule did not let the push in within the deadline.
            StepRefusedError: the step's result would not be finite (nothing applied).
            UnavailableError, CallCancelledError: the shard is stopping; the caller went away.
        """
        with observed(self.observer, "Push", grads):
            job = self._check_call(worker_id, step, incarnation, "push")
            grads = job.checked_grads(grads)
            optimizers = job.step_optimizers(options)
            with self._cond:
                self._members.check(worker_id, session)
                self._check_member(worker_id, step)
                self._touch(worker_id)
                self._wait_agreed(worker_id, timeout, cancelled)
                if self._job is not job:  # worker 0 set a restored job's hyper-parameters
                    optimizers = self._require_job().step_optimizers(options)
                policy = self._require_policy()
                self._check_ahead(policy, worker_id, step)
                skipped = self._skip(policy, worker_id, step)
                if skipped is not None:
                    return skipped
                self._wait(
                    lambda: (
                        policy.push_ready(self._clocks(), worker_id, step)
                        and policy.admits(self._clocks(), step)
                    ),
                    timeout,
                    cancelled,
                    lambda: f"push by worker {worker_id}: " + self._waiting_for(policy, step),
                )
                # The wait released the lock: a retry of this push may have landed meanwhile.
                skipped = self._skip(policy, worker_id, step)
                if skipped is not None:
                    return skipped
                self._steps.take(worker_id, step, optimizers, options.skip)
                self._open(step)
                update = policy.submit(self._clocks(), worker_id, step, grads, owned=take)
                if update is not None:
                    self._apply(update, sync_round=policy.name == "sync")
                self._finished[worker_id] = max(self._finished.get(worker_id, 0), step + 1)
                self._counters["applied"] += 1
                self._capture_due()
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
        session: str = "",
        cancelled: threading.Event | None = None,
        options: StepOptions = NO_OPTIONS,
        rows: Sequence[tuple[str, np.ndarray]] = (),
    ) -> tuple[PushResult, Any, int]:
        """``push``, then ``pull`` of every variable that is not a table, and of ``rows``
        ((table, ids) pairs: the next batch's rows), at the step the worker goes on to
        (``PushResult.next_step``): (the push's result, the snapshot, the clock read at).

        Raises:
            as ``push`` and ``pull``.
        """
        result = self.push(
            worker_id, step, grads, timeout, incarnation, take, session, cancelled, options
        )
        # With rows, a pull reads only what it names: name every dense variable too.
        names = self._require_job().pull_keys((), ()) if rows else ()
        snapshot, clock = self.pull(
            worker_id,
            result.next_step,
            names,
            timeout=timeout,
            encode=encode,
            rows=rows,
            incarnation=incarnation,
            cancelled=cancelled,
        )
        with self._cond:  # who was missing by the time the step could be read
            result.absent = self._absent()
        result.skipped = options.skip or self.step_skipped(step)
        return result, snapshot, clock

    def _check_call(
        self, worker_id: int, step: int, incarnation: str, what: str, reader: bool = False
    ) -> Job:
        """The checks every pull and push makes before touching anything; returns the job.

        Raises:
            ShardRestartedError, NotInitializedError, InvalidRequestError, StepRefusedError.
        """
        self._check_incarnation(incarnation, worker_id, what)
        job = self._require_job()
        if not (reader and worker_id == OBSERVER):
            self._check_worker(worker_id, job.num_workers, what)
        if step < 0:
            raise InvalidRequestError(f"{what} by worker {worker_id} has negative step {step}")
        if step >= MAX_STEP:
            raise InvalidRequestError(f"{what} by worker {worker_id} has step {step} >= 2**62")
        if self._failure:
            raise StepRefusedError(self._failure)
        return job

    def _check_ahead(self, policy: ConsistencyPolicy, worker_id: int, step: int) -> None:
        """Refuses a step past the one this worker is expected to push next (plus the slack).

        Raises:
            InvalidRequestError: naming the step, the expected one and the limit.
        """
        expected = self._finished.get(worker_id, 0)
        if policy.name == "sync":
            expected = max(expected, self._updates)
        if step > expected + self.limits.max_step_ahead:
            raise InvalidRequestError(
                f"push by worker {worker_id} is for step {step}, but its next step here is "
                f"{expected} (at most {self.limits.max_step_ahead} ahead allowed: "
                "psserver --max-step-ahead); a step from the future would make this worker's "
                "real pushes look like retries"
            )

    def _skip(self, policy: ConsistencyPolicy, worker_id: int, step: int) -> PushResult | None:
        reason = policy.classify(self._clocks(), worker_id, step)
        if reason is None:
            return None
        self._counters[reason] += 1
        return self._result(False, reason, worker_id, step)

    def _result(self, applied: bool, reason: str, worker_id: int, step: int) -> PushResult:
        # After a late sync push the worker moves on to the step the shard is in.
        after = max(step + 1, self._updates) if reason == "late" else step + 1
        absent = self._absent()
        durable = self._durable.get(worker_id, 0)
        return PushResult(applied, reason, self._updates, durable, after, absent, self.job_id)

    def _apply(self, update: Mapping[str, Any], sync_round: bool) -> None:
        """Applies an update (lock held). A sync round that cannot be applied has been consumed
        (its pushes are gone), so the refusal is kept: every later step fails with it.

        Raises:
            StepRefusedError: the update's result would not be finite; nothing applied.
        """
        optimizers, skip = self._steps.pop(self._updates)
        try:
            self._state.apply(self._require_job(), update, optimizers, skip, summed=sync_round)
        except StepRefusedError as exc:
            if sync_round:
                self._failure = (
                    f"step {self._updates} was refused and not applied: {exc}; the shard holds "
                    "the weights from before it. Restart the job (from a checkpoint) with a "
                    "smaller learning rate or gradient scaling"
                )
                self._cond.notify_all()
                raise StepRefusedError(self._failure) from None
            raise
        self._updates += 1

    def _membership_changed(self) -> None:
        """Re-evaluates the rule after workers left (lock held); a round may close now."""
        assert self._policy is not None
        update = self._policy.membership_changed(self._clocks())
        if update is not None:
            # A refusal is kept as the shard's failure: every waiting call wakes to it.
            with contextlib.suppress(StepRefusedError):
                self._apply(update, sync_round=True)
            self._capture_due()
        self._cond.notify_all()

    def _clocks(self) -> Clocks:
        # The live dict, not a copy: policies only read it, under the lock, and keep nothing.
        return self._members.clocks(self._updates, self._finished, self._opened)

    def _touch(self, worker_id: int) -> None:
        if worker_id == OBSERVER:
            return  # a reader such as psctl export is no worker: it must not join the quorum
        if self._members.touch(worker_id, self._now()):
            self._record(self._finished.get(worker_id, 0), worker_id, "rejoined")
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
                f"{what} from worker {worker_id}, but the job has workers 0..{num_workers - 1}"
            )

    def _require_policy(self) -> ConsistencyPolicy:
        assert self._policy is not None
        return self._policy

    def _wait_values(self, timeout: float | None, cancelled: threading.Event | None) -> None:
        self._wait(
            lambda: self._ready,
            timeout,
            cancelled,
            lambda: "initial values from the initialising worker (worker 0) never arrived",
        )

    def _wait(
        self,
        ready: Callable[[], bool],
        timeout: float | None,
        cancelled: threading.Event | None,
        describe: Callable[[], str],
    ) -> None:
        """Waits (lock held) until ``ready()``, dropping silent workers meanwhile.

        Raises:
            WaitTimeoutError: not ready within the deadline; the message says what was missing.
            StepRefusedError: the shard refused a step meanwhile.
            UnavailableError: the shard is stopping.
            CallCancelledError: the caller went away.
        """
        limit = self.limits.max_wait_s if timeout is None else min(timeout, self.limits.max_wait_s)
        deadline = time.monotonic() + max(0.0, limit)
        # Wake up often enough to notice a worker passing its heartbeat timeout.
        hb = self.limits.heartbeat_timeout_s
        tick = min(1.0, hb / 4) if hb > 0 else 1.0
        while True:
            if self._failure:
                raise StepRefusedError(self._failure)
            if ready():
                return
            if self._closed:
                raise UnavailableError(f"the shard is stopping; was waiting for {describe()}")
            if cancelled is not None and cancelled.is_set():
                raise CallCancelledError(f"the caller went away while waiting for {describe()}")
            if self._expire():
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(f"gave up after {limit:.1f}s waiting for {describe()}")
            self._cond.wait(min(remaining, tick))
