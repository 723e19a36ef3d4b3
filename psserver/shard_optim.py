"""The shard's optimizer side: each update's hyper-parameters and skip, and which optimizer
state worker 0 loaded."""

from __future__ import annotations

from collections import OrderedDict

from pscore.job import Job
from pscore.optim import Optimizer
from pscore.optspec import NO_OPTIONS, StepOptions
from pswire.errors import HyperParameterMismatchError

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


class OptimizerSide:
    """A job's per-update settings (``steps``) and the digest of the optimizer state worker 0
    loaded (``loaded``; None: none); not thread-safe (the shard's lock guards it). Made afresh
    for each job a shard starts (none: before any)."""

    def __init__(self, job: Job | None) -> None:
        self.steps = StepSettings(job is not None and job.mode == "sync")
        self.loaded: str | None = None

    def forget_load(self, worker_id: int) -> None:
        """Worker 0 (re)starting: a load it made before no longer stands for the job."""
        if worker_id == 0:
            self.loaded = None
