"""The shard's optimizer side: each update's hyper-parameters and skip, and loading or reading
the optimizer state (a mixin of ``Shard``, which holds the lock, the job and the state)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from pscore.job import Job
from pscore.optim import Optimizer
from pscore.optspec import NO_OPTIONS, StepOptions
from psserver.shard_parts import ShardParts
from pswire.errors import HyperParameterMismatchError, InvalidRequestError, ModelMismatchError

__all__ = ["NO_OPTIONS", "OptimizerSide", "StepOptions", "StepSettings"]

# Skipped sync steps remembered for pulls that ask about them (a pull asks about the step it
# just pushed): far more than any worker can lag behind.
REMEMBERED_SKIPS = 4096


class StepSettings:
    """The hyper-parameters and skip flag the next update applies with.

    ``async``/``ssp``: each push's own (taken, then applied at once). ``sync``: the step's,
    set by its first push; a later push of that step with other values is refused, and a
    skip by any push skips the step's optimizer update. Not thread-safe (the shard's lock).
    """

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self._step: tuple[int, int, tuple[Optimizer, ...]] | None = None  # step, worker, values
        self._skip = False
        self._skipped: OrderedDict[int, None] = OrderedDict()  # sync steps skipped, oldest first

    def take(self, worker: int, step: int, optimizers: tuple[Optimizer, ...], skip: bool) -> None:
        """Records one push's values (checked by the caller) before it is submitted.

        Raises:
            HyperParameterMismatchError: sync, and the step's first push carried other values.
        """
        if self.sync and self._step is not None and self._step[0] == step:
            _, first, agreed = self._step
            if optimizers != agreed:
                raise HyperParameterMismatchError(
                    _disagreement(step, first, agreed, worker, optimizers)
                )
            self._skip = self._skip or skip
            return
        self._step = (step, worker, optimizers)
        self._skip = skip

    def pop(self, update: int) -> tuple[tuple[Optimizer, ...] | None, bool]:
        """(each group's optimizer, skip) for the update applied now (number ``update``);
        forgets them. None: no push said (the job's own values)."""
        taken, skip = self._step, self._skip
        self._step, self._skip = None, False
        if skip and self.sync:
            self._skipped[update] = None
            while len(self._skipped) > REMEMBERED_SKIPS:
                self._skipped.popitem(last=False)
        return (taken[2] if taken else None), skip

    def skipped(self, step: int) -> bool:
        """sync: whether ``step`` closed with no optimizer update (some worker skipped it)."""
        return step in self._skipped


def _disagreement(
    step: int, first: int, agreed: tuple[Optimizer, ...], worker: int, mine: tuple[Optimizer, ...]
) -> str:
    parts = []
    for group, (a, b) in enumerate(zip(agreed, mine, strict=True)):
        if a != b:
            pa, pb = a.params(), b.params()
            keys = [k for k in pa if pa[k] != pb[k]]
            parts.append(
                f"parameter group {group}: worker {first} pushed "
                f"{ {k: pa[k] for k in keys} }, worker {worker} pushed { {k: pb[k] for k in keys} }"
            )
    return (
        f"sync step {step}: the workers' hyper-parameters differ ({'; '.join(parts)}); the "
        "pushes of one step must carry the same values (every worker on the same schedule)"
    )


class OptimizerSide(ShardParts):
    """``Shard``'s methods for per-update hyper-parameters, skips and optimizer state."""

    def _start_optimizer_side(self, job: Job | None) -> None:
        """Fresh per-update settings and no loaded state, for a job now starting."""
        self._steps = StepSettings(job is not None and job.mode == "sync")
        self._loaded: str | None = None  # digest of the state worker 0 loaded

    def step_skipped(self, step: int) -> bool:
        """sync: whether ``step`` closed with no optimizer update because a worker skipped it
        (its GradScaler found inf/NaN); otherwise False."""
        with self._cond:
            return self._steps.skipped(step)

    def optimizer_state(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Copies of every trained variable's optimizer slots (slots not made yet, such as
        SGD's momentum buffer before the first step, left out).

        Raises:
            NotInitializedError: no job yet.
            WaitTimeoutError: no initial values within the deadline.
        """
        self._require_job()
        with self._cond:
            self._wait_values(timeout, None)
            return self._state.optimizer_state()

    def load_state(
        self,
        worker_id: int,
        digest: str,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        timeout: float | None = None,
    ) -> None:
        """Worker 0: its ``values`` and ``slots`` replace the shard's (every trained variable's
        slots; those not given start afresh). Another worker: waits for worker 0's load and
        checks that it loaded the same state (``digest``).

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError, UnknownVariableError: a bad state (nothing changed), or state
                sent by a worker other than 0.
            ModelMismatchError: this worker loaded another state than worker 0.
            WaitTimeoutError: worker 0 did not load within the deadline.
        """
        job = self._require_job()
        if worker_id != 0 and (values or slots):
            raise InvalidRequestError(
                f"worker {worker_id} sent optimizer state: only worker 0's is loaded (the "
                "others send the digest of theirs)"
            )
        with self._cond:
            self._wait_values(timeout, None)
            if worker_id == 0:
                self._state.load(job, values or {}, slots)
                self._loaded = digest
                self._cond.notify_all()
                return
            self._wait(
                lambda: self._loaded is not None,
                timeout,
                None,
                lambda: f"worker 0 to load its optimizer state (worker {worker_id} has loaded)",
            )
            if self._loaded != digest:
                raise ModelMismatchError(
                    f"worker {worker_id} loaded another optimizer state than worker 0 (state "
                    f"digest {digest}, worker 0's {self._loaded}): load the same checkpoint on "
                    "every worker"
                )

    def _forget_load(self, worker_id: int) -> None:
        """Worker 0 (re)starting: a load it made before no longer stands for the job."""
        if worker_id == 0:
            self._loaded = None
