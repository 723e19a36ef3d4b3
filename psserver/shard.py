"""A shard: its variables, their optimizer state, worker clocks and the consistency rule.

Plain Python: no grpc here. The servicer decodes requests into calls on ``Shard`` and encodes
what comes back; every error is a ``PSError`` whose status the servicer sends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from psserver.consistency import Clocks, ConsistencyPolicy, make_policy
from pswire.codec import check_tensor
from pswire.errors import (
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    TooLargeError,
    UnknownVariableError,
    WaitTimeoutError,
)
from pswire.optim import Optimizer


@dataclass(frozen=True)
class VarSpec:
    """A variable (or slice) on this shard; ``average``: a buffer, not trained (see _apply)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    average: bool = False


@dataclass(frozen=True)
class Job:
    """What every worker of a job must agree on with this shard."""

    mode: str
    staleness: int
    num_workers: int
    optimizer: Optimizer
    variables: tuple[VarSpec, ...]
    model_digest: str

    def differences(self, other: Job) -> list[str]:
        """Human-readable list of what differs from ``other`` (the shard's job)."""
        out = []
        for attr in ("mode", "staleness", "num_workers", "model_digest"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            if mine != theirs:
                out.append(f"{attr}: shard has {theirs!r}, worker sent {mine!r}")
        if self.optimizer != other.optimizer:
            out.append(f"optimizer: shard has {other.optimizer}, worker sent {self.optimizer}")
        if self.variables != other.variables:
            theirs_by = {v.key: v for v in other.variables}
            mine_by = {v.key: v for v in self.variables}
            for key in sorted(set(theirs_by) | set(mine_by)):
                a, b = theirs_by.get(key), mine_by.get(key)
                if a != b:
                    have = f"{a.shape} {a.dtype}" if a else "nothing"
                    sent = f"{b.shape} {b.dtype}" if b else "nothing"
                    out.append(f"variable '{key}': shard has {have}, worker sent {sent}")
        return out


@dataclass(frozen=True)
class Limits:
    max_workers: int = 1024
    max_variables: int = 100_000
    max_request_bytes: int = 8 << 30
    max_wait_s: float = 300.0


@dataclass
class PushResult:
    applied: bool
    reason: str
    clock: int


@dataclass
class WorkerInfo:
    worker_id: int
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class ShardStatus:
    initialized: bool
    job: Job | None
    clock: int
    workers: dict[int, tuple[int, float]]  # worker -> (steps finished, seconds since heard)
    total_bytes: int
    pushes_applied: int
    pushes_duplicate: int


class Shard:
    """One parameter-server shard; thread-safe, every wait bounded."""

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or Limits()
        self._now = clock
        self._cond = threading.Condition()
        self._job: Job | None = None
        self._policy: ConsistencyPolicy | None = None
        self._vars: dict[str, np.ndarray] = {}
        self._slots: dict[str, dict] = {}
        self._specs: dict[str, VarSpec] = {}
        self._finished: dict[int, int] = {}
        self._workers: dict[int, WorkerInfo] = {}
        self._ready = False  # initial values installed
        self._updates = 0
        self._applied = 0
        self._duplicates = 0

    # -- membership -------------------------------------------------------------------------

    def register_worker(self, worker_id: int, num_workers: int) -> tuple[int, bool]:
        """Records a worker; returns (steps it has finished here, whether values are present).

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
            self._workers[worker_id] = WorkerInfo(worker_id, self._now())
            return self._finished.get(worker_id, 0), self._ready

    def heartbeat(self, worker_id: int) -> int:
        """Marks a worker alive; returns the steps it has finished here."""
        with self._cond:
            info = self._workers.get(worker_id)
            if info is None:
                self._workers[worker_id] = info = WorkerInfo(worker_id)
            info.last_seen = self._now()
            return self._finished.get(worker_id, 0)

    # -- init -------------------------------------------------------------------------------

    def init(self, worker_id: int, job: Job, values: Mapping[str, np.ndarray] | None) -> bool:
        """Agrees on the job; installs initial values if none are held yet.

        Returns whether ``values`` were installed (False when the shard already had values:
        a restarted or later worker never overwrites trained weights).

        Raises:
            InvalidRequestError: bad job description or values.
            ModelMismatchError: the job differs from the one the shard holds.
            TooLargeError: more variables than the shard's limit.
        """
        self._check_job(job)
        if values is not None:
            self._check_values(job, values)
        with self._cond:
            if self._job is None:
                self._job = job
                self._policy = make_policy(job.mode, job.staleness)
                self._specs = {v.key: v for v in job.variables}
            else:
                diffs = job.differences(self._job)
                if diffs:
                    raise ModelMismatchError(
                        f"worker {worker_id}'s job differs from the one this shard holds: "
                        + "; ".join(diffs[:10])
                    )
            if values is None or self._ready:
                return False
            self._vars = {
                key: np.array(values[key], dtype=np.dtype(spec.dtype), copy=True)
                for key, spec in self._specs.items()
            }
            self._slots = {
                k: job.optimizer.make_state(v)
                for k, v in self._vars.items()
                if not self._specs[k].average
            }
            self._ready = True
            self._cond.notify_all()
            return True

    def _check_job(self, job: Job) -> None:
        if job.num_workers < 1 or job.num_workers > self.limits.max_workers:
            raise InvalidRequestError(
                f"num_workers must be in [1, {self.limits.max_workers}], got {job.num_workers}"
            )
        make_policy(job.mode, job.staleness)  # validates mode and staleness
        if len(job.variables) > self.limits.max_variables:
            raise TooLargeError(
                f"job declares {len(job.variables)} variables on this shard, over the limit "
                f"of {self.limits.max_variables}"
            )
        keys = [v.key for v in job.variables]
        if len(set(keys)) != len(keys):
            raise InvalidRequestError(f"job declares a variable twice: {keys}")

    def _check_values(self, job: Job, values: Mapping[str, np.ndarray]) -> None:
        specs = {v.key: v for v in job.variables}
        for key in values:
            if key not in specs:
                raise UnknownVariableError(
                    f"initial value for variable '{key}', which the job does not declare"
                )
        for key, spec in specs.items():
            if key not in values:
                raise InvalidRequestError(f"initial values lack variable '{key}'")
            check_tensor(key, spec.shape, spec.dtype, values[key], "initial value")

    # -- pull / push ------------------------------------------------------------------------

    def pull(
        self, worker_id: int, step: int, names: Sequence[str] = (), timeout: float | None = None
    ) -> tuple[dict[str, np.ndarray], int]:
        """Snapshot of the variables once the consistency rule lets a worker at ``step`` read.

        Raises:
            NotInitializedError: no job yet.
            UnknownVariableError: a name the shard does not hold.
            WaitTimeoutError: the rule or the initial values did not allow reading in time.
        """
        job = self._require_job()
        keys = list(names) if names else [v.key for v in job.variables]
        for key in keys:
            if key not in self._specs:
                raise UnknownVariableError(self._unknown(key))
        with self._cond:
            self._wait_values(timeout)
            policy = self._policy
            assert policy is not None
            self._wait(
                lambda: policy.read_ready(self._clocks(), step),
                timeout,
                lambda: f"pull by worker {worker_id}: " + policy.waiting_for(self._clocks(), step),
            )
            self._touch(worker_id)
            return {k: self._vars[k].copy() for k in keys}, self._updates

    def push(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray],
        timeout: float | None = None,
    ) -> PushResult:
        """Takes one worker's gradients for one step, applying them as the rule says.

        A push is applied at most once per (worker, step); a duplicate is acknowledged with
        ``applied=False``. Nothing changes unless every gradient is valid.

        Raises:
            NotInitializedError: no job yet.
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: bad gradients.
            WaitTimeoutError: the rule did not let the push in within the deadline.
        """
        job = self._require_job()
        if not 0 <= worker_id < job.num_workers:
            raise InvalidRequestError(
                f"push from worker {worker_id}, but the job has workers 0..{job.num_workers - 1}"
            )
        if step < 0:
            raise InvalidRequestError(f"push from worker {worker_id} has negative step {step}")
        for key, grad in grads.items():
            spec = self._specs.get(key)
            if spec is None:
                raise UnknownVariableError(self._unknown(key))
            check_tensor(
                key, spec.shape, spec.dtype, grad, "buffer value" if spec.average else "gradient"
            )
        with self._cond:
            self._wait_values(timeout)
            policy = self._policy
            assert policy is not None
            self._touch(worker_id)
            if policy.is_duplicate(self._clocks(), worker_id, step):
                self._duplicates += 1
                return PushResult(False, "duplicate", self._updates)
            self._wait(
                lambda: policy.push_ready(self._clocks(), worker_id, step),
                timeout,
                lambda: f"push by worker {worker_id}: " + policy.waiting_for(self._clocks(), step),
            )
            # The wait released the lock: a retry of this push may have landed meanwhile.
            if policy.is_duplicate(self._clocks(), worker_id, step):
                self._duplicates += 1
                return PushResult(False, "duplicate", self._updates)
            update = policy.submit(self._clocks(), worker_id, step, grads)
            self._finished[worker_id] = max(self._finished.get(worker_id, 0), step + 1)
            self._applied += 1
            if update is not None:
                self._apply(update)
            self._cond.notify_all()
            return PushResult(True, "", self._updates)

    def _apply(self, update: Mapping[str, np.ndarray]) -> None:
        assert self._job is not None
        opt = self._job.optimizer
        for key, grad in update.items():
            if self._specs[key].average:
                # A buffer (e.g. BatchNorm running stats): the pushed values (averaged over the
                # round in sync mode) replace the stored ones; no optimizer.
                np.copyto(self._vars[key], grad, casting="unsafe")
            else:
                opt.apply(self._vars[key], grad, self._slots[key])
        self._updates += 1

    # -- status -----------------------------------------------------------------------------

    def status(self) -> ShardStatus:
        with self._cond:
            now = self._now()
            workers = {
                w: (self._finished.get(w, 0), now - info.last_seen)
                for w, info in sorted(self._workers.items())
            }
            return ShardStatus(
                initialized=self._ready,
                job=self._job,
                clock=self._updates,
                workers=workers,
                total_bytes=sum(v.nbytes for v in self._vars.values()),
                pushes_applied=self._applied,
                pushes_duplicate=self._duplicates,
            )

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every variable (for tests and checkpoints)."""
        with self._cond:
            return {k: v.copy() for k, v in self._vars.items()}

    # -- internals --------------------------------------------------------------------------

    def _clocks(self) -> Clocks:
        assert self._job is not None
        return Clocks(self._updates, dict(self._finished), frozenset(range(self._job.num_workers)))

    def _touch(self, worker_id: int) -> None:
        info = self._workers.get(worker_id)
        if info is None:
            self._workers[worker_id] = info = WorkerInfo(worker_id)
        info.last_seen = self._now()

    def _require_job(self) -> Job:
        job = self._job
        if job is None:
            raise NotInitializedError(
                "this shard holds no job yet: a worker must call init before pull or push"
            )
        return job

    def _unknown(self, key: str) -> str:
        known = sorted(self._specs)
        shown = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
        return f"variable '{key}' is not on this shard (it holds: {shown})"

    def _wait_values(self, timeout: float | None) -> None:
        self._wait(
            lambda: self._ready,
            timeout,
            lambda: "initial values from the initialising worker (worker 0) never arrived",
        )

    def _wait(
        self, ready: Callable[[], bool], timeout: float | None, describe: Callable[[], str]
    ) -> None:
        limit = self.limits.max_wait_s if timeout is None else min(timeout, self.limits.max_wait_s)
        if not self._cond.wait_for(ready, timeout=max(0.0, limit)):
            raise WaitTimeoutError(f"gave up after {limit:.1f}s waiting for {describe()}")
