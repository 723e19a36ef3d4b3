"""A sync round's next weights, sent while the round's pushes still arrive (``fw.PIPELINED``).

A push streamed from backward (``overlap=True``, psworker/push_stream.py) reaches its shard
tensor by tensor. Answered once the round is applied (every worker's whole push in, then the
whole model back), the upload and the download take turns on each worker's link, where a
ring sends and receives at once. A ``Preview`` computes each variable's next value as soon as
every worker's gradient of it is in, with the round's own inputs and code: the gradients summed
in worker order and averaged as ``SyncPolicy`` does, then ``Variables.apply`` on copies of that
variable's value and optimizer slots (``Variables.shadow``). The data port streams each one
back as it is made (psserver/flight_service.py), so the download runs beside the upload.

A preview is a prediction and never more. The round itself is applied as without one, from the
pushes, once the last is in. Each worker's reply ends with a trailer sent only once the round
has closed, and only where the shard can show the prediction held (``Shard.preview_held``):
every variable was predicted, from values copied while the round was open, and since then the
values changed once (the round's own step), by a round that averaged exactly the preview's
workers with the preview's hyper-parameters. Otherwise (a worker dropped from the round, a
checkpoint loaded, a refusal) the call fails with ABORTED and the worker's link sends the step
again whole: a retry of an applied step, answered with that step's weights. The worker decodes
a preview into its parameters only after backward, and lets the next forward read them only
after the trailer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pscore.checks import NUMPY_DTYPES
from pscore.job import Job
from pscore.variables import Variables
from pswire.errors import PSError

__all__ = ["Preview"]

# How often a wait for a predicted value asks whether its reply was stopped.
_TICK_S = 0.1
# The shard's copies of some variables' values and slots, with its count of value changes
# when it took them; None: the round has closed (too late to predict it).
Base = Callable[[list[str]], "tuple[Variables, int] | None"]


class Preview:
    """One sync round's predicted values, variable by variable; thread-safe.

    ``workers``: the round's members in order (the pushes it will average); ``keys``: the
    variables every push carries and every reply returns; ``optimizers``: the step's
    hyper-parameters; ``base``: the shard's copies of the values the round starts from.
    """

    def __init__(
        self,
        step: int,
        workers: Sequence[int],
        keys: Sequence[str],
        job: Job,
        optimizers: Any,
        base: Base,
    ) -> None:
        self.step = step
        self.workers = tuple(workers)
        self.keys = list(keys)
        self._job = job
        self._optimizers = optimizers
        self._base = base
        self._cond = threading.Condition()
        self._parts: dict[str, dict[int, np.ndarray]] = {}  # key -> worker -> its gradient
        self._values: dict[str, np.ndarray] = {}  # key -> its predicted value
        self._shadows: list[Variables] = []  # the predicted values, slots and measures
        self._bases: set[int] = set()  # the shard's change counts the copies were taken at
        self._failed = ""  # why the preview cannot be completed
        self._pushers: set[int] = set()  # the workers whose push feeds it (``join``)

    def join(self, worker: int) -> bool:
        """``worker``'s push will feed this preview (its gradients to ``add``): False, and
        the preview fails, if one of its pushes already did (a push sent again after its
        stream failed, or another process claiming its id): whose gradients went in is then
        unknown, and the round's own are sent once it closes."""
        with self._cond:
            if worker in self._pushers:
                self._fail(f"worker {worker} pushed step {self.step} twice")
                return False
            self._pushers.add(worker)
            return not self._failed

    def add(self, worker: int, key: str, grad: np.ndarray) -> None:
        """``worker``'s gradient of ``key`` (as it arrived, widened as a push's is); the last
        worker's computes the key's next value (on the caller's thread). A gradient the push
        will refuse (another shape or dtype) fails the preview; its values are checked, as
        the round's, by the step (a mean that is not finite is refused there), and each
        push's own checks still refuse it.
        """
        spec = self._job.specs.get(key)
        if worker not in self.workers or spec is None or spec.table is not None:
            self.fail(f"worker {worker} pushed '{key}', which is not the round's to predict")
            return
        if grad.dtype == np.float16 and spec.dtype == "float32" and not spec.average:
            grad = grad.astype(np.float32)  # as Job.checked_grads widens it
        if grad.dtype != NUMPY_DTYPES.get(spec.dtype) or tuple(grad.shape) != spec.shape:
            self.fail(f"worker {worker}'s '{key}' is not the variable's dtype and shape")
            return
        with self._cond:
            if self._failed or key in self._values:
                return
            parts = self._parts.setdefault(key, {})
            parts[worker] = grad
            if len(parts) < len(self.workers):
                return
            del self._parts[key]
        try:
            shadow, changes = self._next_value(key, [parts[w] for w in self.workers])
        except PSError as exc:  # the step would be refused: the round's own apply says so
            self.fail(str(exc))
            return
        with self._cond:
            self._values[key] = shadow.values[key]
            self._shadows.append(shadow)
            self._bases.add(changes)
            self._cond.notify_all()

    def _next_value(self, key: str, grads: list[np.ndarray]) -> tuple[Variables, int]:
        """``key`` as the round averaging ``grads`` (in worker order) leaves it, as
        ``SyncPolicy`` sums and ``Variables.apply`` steps it: its value, slots and measure,
        in a ``Variables`` of its own.

        Raises:
            StepRefusedError: the result would not be finite.
            PSError: the round has closed (nothing left to predict).
        """
        with np.errstate(over="ignore"):  # an overflow is refused when applied
            # (g0 + g1) + g2 ...: the policy's additions, in its order, one pass fewer.
            acc = grads[0] + grads[1] if len(grads) > 1 else grads[0].copy()
            for grad in grads[2:]:
                acc += grad
        count = len(grads)
        if acc.dtype.kind == "f":
            acc /= acc.dtype.type(count)
        else:  # integer buffers such as BatchNorm's num_batches_tracked
            acc = acc // count
        got = self._base([key])
        if got is None:
            raise PSError(f"step {self.step} closed before '{key}' could be predicted")
        shadow, changes = got
        shadow.apply(self._job, {key: acc}, self._optimizers, skip=False, summed=True)
        return shadow, changes

    def predicted(self) -> list[Variables]:
        """Every variable's prediction (its value, slots and measure): what the round leaves
        once ``held`` says so (``Shard._apply`` installs them instead of stepping again)."""
        with self._cond:
            return list(self._shadows)

    def fed_by(self, worker: int) -> bool:
        """Whether ``worker``'s push feeds this preview (its arrays are read until every push
        of the round is in: the round sums them only at its close, ``SyncPolicy.defer``)."""
        with self._cond:
            return worker in self._pushers

    def wire_of(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) of ``key``'s value, as a reply carries it."""
        spec = self._job.specs[key]
        return spec.dtype, spec.shape

    def wake(self) -> None:
        """Every ``value`` waiting asks its ``stopped`` again now."""
        with self._cond:
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """No more values will be predicted: every wait for one ends."""
        with self._cond:
            self._fail(why)

    def _fail(self, why: str) -> None:
        if not self._failed:
            self._failed = why
        self._parts.clear()
        self._cond.notify_all()

    def value(self, key: str, deadline: float, stopped: Callable[[], bool]) -> np.ndarray | None:
        """``key``'s predicted value once it is made; None if it never will be (the preview
        failed), ``stopped()`` turned true, or ``deadline`` (``time.monotonic()``) passed."""
        with self._cond:
            while key not in self._values:
                left = deadline - time.monotonic()
                if self._failed or left <= 0 or stopped():
                    return None
                self._cond.wait(min(left, _TICK_S))
            return self._values[key]

    def made(self, key: str) -> np.ndarray | None:
        """``key``'s predicted value if it is made already (no wait)."""
        with self._cond:
            return self._values.get(key)

    def held(
        self, changes: int, closed_with: tuple[int, ...], updates: int, applied: tuple[Any, bool]
    ) -> bool:
        """Whether every prediction is the round's value (the shard's lock held, the round
        closed): each was made from the values the round started from (copied at one change
        count), the values changed once since (``changes``: the round's own step), and that
        round (``updates``: the step after it) averaged exactly the preview's workers, with
        the preview's hyper-parameters and no skip (``applied``)."""
        with self._cond:
            return (
                not self._failed
                and len(self._values) == len(self.keys)
                and self._bases == {changes - 1}
                and closed_with == self.workers
                and updates == self.step + 1
                and applied == (self._optimizers, False)
            )
