"""A step's next weights, sent while its pushes still arrive (``fw.PIPELINED``): a sync
round's (``Preview``), or an async push's (``AsyncChain``).

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
checkpoint loaded, a refusal) the call fails with UNAVAILABLE and the worker's link sends the
step again whole: a retry of an applied step, answered with that step's weights. The worker
reads a preview from its start, keeps what arrives during backward aside (psworker/
flight_link.py ``StagedInto``), puts it into its parameters only after backward, and lets the
next forward read them only after the trailer.

In async each push is applied alone, on arrival, so its next values depend on the pushes
applied before it. ``AsyncChain`` orders the pushes that stream at once by when they began and
predicts each from the predictions of the one before it; each is installed in that order only
where the one before it was and nothing else changed the values, and is otherwise applied
whole as without a preview (its worker sends the step again).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pscore.checks import NUMPY_DTYPES
from pscore.job import Job
from pscore.variables import Variables
from pswire.errors import PSError

__all__ = ["CHAIN_WAIT_S", "AsyncChain", "Preview"]

# How often a wait for a predicted value asks whether its reply was stopped.
_TICK_S = 0.1
# An async push's preview waits this long, at most, for the one before it (a tensor's
# prediction, or its push applied), and is not made behind one silent for longer.
CHAIN_WAIT_S = 2.0
_CHAINED = -1  # the "change count" of a base that is another preview's predictions
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
        after: Preview | None = None,
        private: bool = True,
    ) -> None:
        self.step = step
        self.workers = tuple(workers)
        self.after = after  # async: the push this one's values build on (``AsyncChain``)
        self.installed = False  # the step it predicted was installed (set by the shard)
        # Whether its values stay its own until every reply has them: not an async push's,
        # installed as the shard's own values, which the next push changes in place (its
        # reply is written out before it is applied).
        self.private = private
        self.keys = list(keys)
        self._job = job
        self._optimizers = optimizers
        self._base = base
        self._cond = threading.Condition()
        self._parts: dict[str, dict[int, np.ndarray]] = {}  # key -> worker -> its gradient
        self._values: dict[str, np.ndarray] = {}  # key -> its predicted value
        self._shadows: dict[str, Variables] = {}  # key -> its predicted value, slots, measure
        self._bases: set[int] = set()  # the shard's change counts the copies were taken at
        self._failed = ""  # why the preview cannot be completed
        self._pushers: set[int] = set()  # the workers whose push feeds it (``join``)
        self._heard = time.monotonic()  # the last gradient added (``stalled``)

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
            self._heard = time.monotonic()
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
            self._shadows[key] = shadow
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
        if len(grads) == 1:
            # One push (async, or a sync job of one worker): its own array, which the
            # optimizer only reads, as the push's own apply would (no copy, no division).
            acc = grads[0]
        else:
            with np.errstate(over="ignore"):  # an overflow is refused when applied
                # (g0 + g1) + g2 ...: the policy's additions, in its order, one pass fewer.
                acc = grads[0] + grads[1]
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
            return list(self._shadows.values())

    def shadow_for(self, key: str, deadline: float) -> Variables | None:
        """A copy of ``key``'s prediction (value, slots, measure) once it is made: the base
        of the push predicted after this one (``AsyncChain``); None if it never will be by
        ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            while key not in self._shadows:
                left = deadline - time.monotonic()
                if self._failed or left <= 0:
                    return None
                self._cond.wait(min(left, _TICK_S))
            return self._shadows[key].shadow([key])

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
        self,
        changes: int,
        closed_with: tuple[int, ...],
        updates: int,
        applied: tuple[Any, bool],
        installed: tuple[Preview, int] | None = None,
    ) -> bool:
        """Whether every prediction is the round's value (the shard's lock held, the round
        closed): each was made from the values the round started from (copied at one change
        count), the values changed once since (``changes``: the round's own step), and that
        round (``updates``: the step after it) averaged exactly the preview's workers, with
        the preview's hyper-parameters and no skip (``applied``). A push predicted ``after``
        another (``AsyncChain``) started from that one's predictions instead: they must be
        the last change, installed (``installed``: the preview and the change count then)."""
        with self._cond:
            if self.after is None:
                based = self._bases == {changes - 1}
            else:
                based = self._bases == {_CHAINED} and installed == (self.after, changes - 1)
            return (
                not self._failed
                and based
                and len(self._values) == len(self.keys)
                and closed_with == self.workers
                and updates == self.step + 1
                and applied == (self._optimizers, False)
            )

    def stalled(self, now: float) -> bool:
        """Whether its push has sent nothing for ``CHAIN_WAIT_S`` (a paused or slow worker:
        no other push is predicted after it)."""
        with self._cond:
            return bool(self._failed) or now - self._heard > CHAIN_WAIT_S


class AsyncChain:
    """The async pushes whose replies are predicted while they arrive (``fw.PIPELINED``), in
    the order they began: each one's values are predicted from the values the push before it
    leaves (its predictions), and each is installed, in that order, only where the one before
    it was installed and nothing else changed the values since (``Preview.held``); a push is
    applied on arrival as always, so a prediction that does not hold costs its worker a
    resend, never a different model. Every method is called with the shard's lock held.
    """

    def __init__(self) -> None:
        self._open: list[Preview] = []  # in the order their pushes began
        self._of: dict[tuple[int, int], Preview] = {}  # (worker, step) -> its preview
        self.installed: tuple[Preview, int] | None = None  # the last installed, and when

    def join(
        self,
        worker: int,
        step: int,
        update: int,
        keys: Sequence[str],
        job: Job,
        optimizers: Any,
        base: Base,
    ) -> Preview | None:
        """``worker``'s push of ``step`` begins (its values the ``update``-th applied if
        nothing else comes first): its preview, after the last open one; None if that one
        is stalled, or this push already has one (it is sent again)."""
        if (worker, step) in self._of:
            self._of[(worker, step)].fail(f"worker {worker} pushed step {step} twice")
            return None
        tail = self._open[-1] if self._open else None
        if tail is not None and tail.stalled(time.monotonic()):
            return None
        if tail is not None:
            base = functools.partial(_after, tail)
        made = Preview(
            update + len(self._open), (worker,), keys, job, optimizers, base, tail, private=False
        )
        made.join(worker)
        self._open.append(made)
        self._of[(worker, step)] = made
        return made

    def of(self, worker: int, step: int) -> Preview | None:
        """The preview of ``worker``'s push of ``step``, if it has one still open."""
        return self._of.get((worker, step))

    def ready(self, preview: Preview) -> bool:
        """Whether the push before ``preview``'s was applied (or given up): its turn."""
        return preview.after is None or preview.after not in self._open

    def resolve(self, preview: Preview, installed: bool, changes: int) -> None:
        """``preview``'s push was applied (``installed``: its predictions, the values'
        ``changes``-th change) or never will be with them: the previews after it, built on
        its values, can then never hold."""
        if preview not in self._open:
            return
        at = self._open.index(preview)
        if installed:
            preview.installed = True
            self.installed = (preview, changes)
        else:
            for later in self._open[at + 1 :]:
                later.fail("the push it was predicted after was not applied as predicted")
        self._open.remove(preview)
        self._of = {k: v for k, v in self._of.items() if v is not preview}

    def clear(self, why: str) -> None:
        """The values changed otherwise (a push sent whole): no open preview can hold."""
        for preview in self._open:
            preview.fail(why)


def _after(before: Preview, keys: list[str]) -> tuple[Variables, int] | None:
    """A chained preview's base: copies of ``before``'s predictions of ``keys``."""
    deadline = time.monotonic() + CHAIN_WAIT_S
    copies = Variables()
    for key in keys:
        shadow = before.shadow_for(key, deadline)
        if shadow is None:
            return None
        copies.adopt([shadow])
    return copies, _CHAINED
