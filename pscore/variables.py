"""A shard's model state: its dense variables, their optimizer slots and its table rows.

Plain data with the optimizer step; no locking (the shard's lock guards every call) and no
rule about when anything happens (the shard and its consistency policy decide that).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pscore.checks import (
    BATCH_ARRAYS,
    all_finite,
    all_finite_together,
    batched,
    check_tensor,
    sum_squares,
)
from pscore.job import Job, VarSpec
from pscore.optim import Optimizer
from pscore.rowstore import RowStore, TableState
from pscore.tables import RowSparse
from pswire.errors import InvalidRequestError, StepRefusedError, UnknownVariableError

# An update is computed with the old values kept (and checked before they are dropped) when an
# input's sum of squares passes this (some |x| near 1e15 or more) or a hyper-parameter passes
# HYPER_SAFE: below both, none of our optimizers can overflow float32.
SAFE_SUM_SQUARES = 1e30
HYPER_SAFE = 1e6


class Variables:
    """What one shard stores for its job: empty until ``install`` or ``restore``."""

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict] = {}
        self.tables: dict[str, RowStore] = {}
        self._squares: dict[str, float] = {}  # key -> largest sum of squares (risk check)

    def install(self, job: Job, values: Mapping[str, np.ndarray], take: bool) -> None:
        """Starting values (checked against ``job`` by the caller) and fresh optimizer state;
        tables start from their seeded initialiser: no worker sends (or holds) them.

        ``take``: the caller hands the arrays over, so writable ones of the right dtype are
        kept as they are instead of copied.
        """
        specs = job.specs
        self.values = {
            key: _owned(values[key], spec.dtype, take)
            for key, spec in specs.items()
            if spec.table is None
        }
        self.slots = {
            k: job.optimizer_of(k).make_state(v)
            for k, v in self.values.items()
            if not specs[k].average
        }
        self.tables = {
            key: RowStore(spec.table, job.optimizer_of(key), (job.shard, job.num_shards))
            for key, spec in specs.items()
            if spec.table is not None
        }
        for key in self.slots:
            self._measure(key)

    def apply(
        self,
        job: Job,
        update: Mapping[str, Any],
        optimizers: tuple[Optimizer, ...] | None = None,
        skip: bool = False,
        summed: bool = True,
        known_squares: Mapping[str, float] | None = None,
    ) -> None:
        """One optimizer step with ``update`` (gradients by key; rows for tables).

        ``optimizers``: each parameter group's for this update (``Job.step_optimizers``);
        None: as the job started. ``skip``: no optimizer step (a GradScaler found inf/NaN);
        buffers still take their values. A buffer (e.g. BatchNorm running stats) takes the
        pushed values (averaged over the round in sync mode) with no optimizer. ``summed``:
        the update sums several pushes (sync), so a table's rows may have overflowed; False:
        it is one push, whose rows were checked as it arrived. ``known_squares``: the sums
        of squares of some of ``update``'s gradients, already measured (``Job.checked_grads``
        of these very arrays), which are then not measured again; ignored when ``summed``
        (a sum's arrays are not those its pushes' checks measured).

        Nothing non-finite is ever stored, and a refused update changes nothing: one whose
        gradient is not finite (a sum that overflowed) is refused before anything changes;
        tables' rows are stepped first, each table's old rows kept, and put back when any
        later result is not finite; dense variables whose inputs are large enough that the
        optimizer could overflow are computed with the old values kept, and restored when any
        result is not finite; buffers take their values last.

        Raises:
            StepRefusedError: a gradient or a result is not finite; nothing changed (dense
                variables whose inputs were too small to be backed up, yet overflowed, are
                named as changed).
        """
        groups = optimizers or job.optimizers
        specs = job.specs
        # One push's rows were checked as they arrived (and the result is checked too).
        checked = [
            (key, grad.values if isinstance(grad, RowSparse) else grad)
            for key, grad in update.items()
            if summed or not isinstance(grad, RowSparse)
        ]
        small = all_finite_together([values for _, values in checked])
        # One pass over each gradient measures it for both checks: finite (a finite sum of
        # squares proves it; else the exact check decides) and the risk of overflow below.
        # A push's own gradients were measured as they were checked (``known_squares``, from
        # ``Job.checked_grads``): those sums serve. A sum of pushes is measured here: its
        # arrays are new, or were summed into since their checks.
        known = {} if summed or known_squares is None else known_squares
        grad_squares: dict[str, float] = {}
        for key, values in checked:
            if small and batched(values):
                continue
            found = known.get(key)
            squares = grad_squares[key] = found if found is not None else sum_squares(values)
            if not np.isfinite(squares) and not all_finite(values):
                raise StepRefusedError(
                    f"the gradient to apply to '{key}' is not finite (a sum or average of "
                    "finite gradients overflowed); nothing was applied"
                )
        trained = [
            k
            for k, g in update.items()
            if not skip and not isinstance(g, RowSparse) and not specs[k].average
        ]
        # Tables first, each undoable: a refusal anywhere after puts their rows back.
        undos: list[Callable[[], None]] = []
        try:
            self._step(groups, specs, update, trained, grad_squares, skip, undos)
        except BaseException:
            for undo in reversed(undos):
                undo()
            raise

    def _step(
        self,
        groups: tuple[Optimizer, ...],
        specs: Mapping[str, VarSpec],
        update: Mapping[str, Any],
        trained: list[str],
        grad_squares: dict[str, float],
        skip: bool,
        undos: list[Callable[[], None]],
    ) -> None:
        """``apply`` once the gradients are checked: the tables' steps (each one's undo added
        to ``undos``), then the dense variables', then the buffers' values.

        Raises:
            StepRefusedError: some result is not finite (the caller undoes the tables).
        """
        refused: list[str] = []
        for key, grad in update.items():
            if isinstance(grad, RowSparse) and not skip and not specs[key].average:
                undo = self.tables[key].step(grad.ids, grad.values, groups[specs[key].group])
                if undo is None:
                    refused.append(key)
                else:
                    undos.append(undo)
        if refused:
            raise StepRefusedError(
                f"the optimizer step made {refused} non-finite (values or optimizer state "
                "overflowed); the variables were left as before"
            )
        risky = bool(trained) and self._risky(groups, update, trained, grad_squares)
        backup = self._backup(trained) if risky else None
        # A large variable's results are measured piece by piece as the step makes them;
        # those of an optimizer whose safe steps are finite by proof are bounded instead
        # (``Optimizer.result_bound``: one pass over each result less).
        measured: dict[str, float] = {}
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite results: see below
            for key in trained:
                optimizer = groups[specs[key].group]
                value = self.values[key]
                bound = None
                if not risky and key in grad_squares:
                    bound = optimizer.result_bound(
                        value.dtype, self._squares[key], grad_squares[key]
                    )
                if bound is not None and not bound <= SAFE_SUM_SQUARES:
                    bound = None  # measured now, so a loose bound never makes a step risky
                result = optimizer.apply_blocked(
                    value, update[key], self.slots[key], measure=bound is None
                )
                if bound is not None:
                    measured[key] = bound
                elif result is not None:
                    measured[key] = result
        failed = set(self._measure_all([k for k in trained if k not in measured]))
        failed.update(k for k, squares in measured.items() if not self._record(k, squares))
        bad = [k for k in trained if k in failed]
        if bad:
            if backup is not None:
                for key, (value, slots) in backup.items():
                    # In place: the values may be a model's own memory (``keep_in``).
                    np.copyto(self.values[key], value)
                    self.slots[key] = slots
                    self._measure(key)
            kept = "the variables were left as before" if backup is not None else "state changed"
            raise StepRefusedError(
                f"the optimizer step made {bad} non-finite (values or optimizer state "
                f"overflowed); {kept}"
            )
        for key, grad in update.items():
            if specs[key].average:
                np.copyto(self.values[key], grad, casting="unsafe")

    def _risky(
        self,
        groups: tuple[Optimizer, ...],
        update: Mapping[str, Any],
        trained: list[str],
        grad_squares: Mapping[str, float],
    ) -> bool:
        """Whether any input is large enough (or a hyper-parameter extreme enough) that the
        optimizer could overflow: then the old values are kept until the results are checked.
        ``grad_squares``: the gradients' sums of squares already measured (by key)."""
        if any(abs(v) > HYPER_SAFE for g in groups for v in g.params().values()):
            return True
        squares = self._squares
        if any(squares.get(key, np.inf) > SAFE_SUM_SQUARES for key in trained):
            return True
        # Many small gradients at once: their squares summed together bound each one's.
        batch = [update[k] for k in trained if batched(update[k])]
        small = len(batch) >= BATCH_ARRAYS and (
            sum_squares(np.concatenate(batch, axis=None)) <= SAFE_SUM_SQUARES
        )
        return any(
            (grad_squares[key] if key in grad_squares else sum_squares(update[key]))
            > SAFE_SUM_SQUARES
            for key in trained
            if not (small and batched(update[key]))
        )

    def keep_in(self, arrays: Mapping[str, np.ndarray]) -> None:
        """From now on holds the values of ``arrays``' variables in those arrays (C-contiguous,
        writable, the variables' shape and dtype, e.g. a CPU model's own tensors' memory),
        after copying the current values into them: a step then updates them in place, and
        every later change to ``values`` (a step, a load, a refused step put back) lands in
        them. Whoever writes to them between steps writes the values.

        Raises:
            UnknownVariableError: a name that is not a dense variable here.
            InvalidRequestError: an array that cannot hold its variable (named).
        """
        for key, array in arrays.items():
            value = self.values.get(key)
            if value is None:
                raise UnknownVariableError(f"keep_in: no variable '{key}'")
            if (
                array.shape != value.shape
                or array.dtype != value.dtype
                or not array.flags.writeable
                or not array.flags.c_contiguous
            ):
                raise InvalidRequestError(
                    f"keep_in: '{key}' is {value.dtype} {value.shape}; the array offered is "
                    f"{array.dtype} {array.shape} (writable {array.flags.writeable}, "
                    f"contiguous {array.flags.c_contiguous})"
                )
        for key, array in arrays.items():
            if not same_memory(array, self.values[key]):
                np.copyto(array, self.values[key])
            self.values[key] = array

    def _backup(self, keys: list[str]) -> dict[str, tuple[np.ndarray, dict]]:
        return {k: (self.values[k].copy(), _copy_slots(self.slots[k])) for k in keys}

    def _measure_all(self, keys: list[str]) -> list[str]:
        """``_measure`` of every key; the keys whose values or slots are not finite. Many
        small float32 variables with the same slots are measured together: per-variable
        numpy calls were most of a step of thousands of small variables."""
        batch: list[str] = []
        alone: list[str] = []
        layout: tuple[str, ...] | None = None
        for key in keys:
            value, slots = self.values[key], self.slots[key]
            names = tuple(n for n, v in slots.items() if _is_array(v))
            if layout is None:
                layout = names
            if names == layout and batched(value) and all(batched(slots[n]) for n in names):
                batch.append(key)
            else:
                alone.append(key)
        if len(batch) < BATCH_ARRAYS:
            return [k for k in keys if not self._measure(k)]
        assert layout is not None
        sizes = np.fromiter((self.values[k].size for k in batch), np.int64, len(batch))
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        columns = [[self.values[k] for k in batch]]
        columns += [[self.slots[k][n] for k in batch] for n in layout]
        with np.errstate(over="ignore", invalid="ignore"):
            sums = []
            for column in columns:
                flat = np.concatenate(column, axis=None)
                sums.append(np.add.reduceat(flat * flat, starts))
            largest = np.maximum.reduce(sums) if len(sums) > 1 else sums[0]
        self._squares.update(zip(batch, largest.tolist(), strict=True))
        unsure = {batch[i] for i in np.flatnonzero(~np.isfinite(largest))}
        bad = {k for k in unsure if not self._finite(k)}
        bad.update(k for k in alone if not self._measure(k))
        return [k for k in keys if k in bad]

    def _finite(self, key: str) -> bool:
        arrays = [self.values[key], *(v for v in self.slots[key].values() if _is_array(v))]
        return all(all_finite(a) for a in arrays)

    def _measure(self, key: str) -> bool:
        """Records the largest sum of squares among a variable and its slots (for the next
        step's risk check); whether all of them are finite."""
        arrays = [self.values[key], *(v for v in self.slots[key].values() if _is_array(v))]
        # np.max, not max(): max(5.0, nan) is 5.0, which would pass a NaN slot as finite.
        return self._record(key, float(np.max([sum_squares(a) for a in arrays])))

    def _record(self, key: str, squares: float) -> bool:
        """Records ``squares``, the largest sum of squares among a variable and its slots
        (for the next step's risk check); whether all of them are finite (a finite measure
        proves it; else they are checked exactly)."""
        self._squares[key] = squares
        return bool(np.isfinite(squares)) or self._finite(key)

    def shadow(self, keys: list[str]) -> Variables:
        """Copies of ``keys``' values, optimizer slots and risk measures, as a ``Variables`` of
        their own: ``apply`` there computes exactly the step it would compute here (every
        optimizer steps each variable on its own), leaving these untouched
        (psserver/pipeline.py's preview of a sync round)."""
        other = Variables()
        other.values = {k: self.values[k].copy() for k in keys}
        other.slots = {k: _copy_slots(self.slots[k]) for k in keys if k in self.slots}
        other._squares = {k: self._squares[k] for k in keys if k in self._squares}
        return other

    def adopt(self, shadows: list[Variables]) -> None:
        """Takes ``shadows``' variables (their values, slots and measures) as these ones' own:
        the step ``apply`` would make, already made on copies (``shadow``)."""
        for shadow in shadows:
            self.values.update(shadow.values)
            self.slots.update(shadow.slots)
            self._squares.update(shadow._squares)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Copies of every trained variable's optimizer slots (slots not made yet left out)."""
        return {
            k: {n: _copy(v) for n, v in s.items() if v is not None} for k, s in self.slots.items()
        }

    def load(
        self, job: Job, values: Mapping[str, np.ndarray], slots: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Replaces the values given and every trained variable's slots: those in ``slots``
        take the given arrays and numbers, the rest start afresh. All checked first: on an
        error nothing changed.

        Raises:
            UnknownVariableError: a value or slot for a variable this shard lacks.
            InvalidRequestError, ShapeMismatchError: a buffer given slots, an unknown slot, a
                wrong shape or dtype, or NaN.
        """
        specs = {v.key: v for v in job.variables if v.table is None}
        for key, value in values.items():
            if key not in specs:
                raise UnknownVariableError(job.unknown(key))
            spec = specs[key]
            check_tensor(key, spec.shape, spec.dtype, value, "loaded value")
        fresh: dict[str, dict[str, Any]] = {}
        for key in slots:
            if key not in self.slots:
                raise UnknownVariableError(
                    f"optimizer state for '{key}', which is not a trained variable here"
                )
        for key in self.slots:
            template = job.optimizer_of(key).make_state(self.values[key])
            for slot, value in slots.get(key, {}).items():
                if slot not in template:
                    raise InvalidRequestError(
                        f"optimizer state of '{key}' has slot '{slot}'; "
                        f"{job.optimizer_of(key).name} keeps {sorted(template)}"
                    )
                fresh_value = template[slot]
                if isinstance(fresh_value, int) and not isinstance(fresh_value, bool):
                    array = np.asarray(value)
                    if array.shape != () or array.dtype.kind not in "iu" or int(array) < 0:
                        raise InvalidRequestError(
                            f"slot '{slot}' of '{key}' must be a count (a 0-d integer >= 0), "
                            f"got {array.dtype} {array.shape}"
                        )
                    template[slot] = int(array)
                else:
                    spec = specs[key]
                    check_tensor(f"{key}:{slot}", spec.shape, spec.dtype, value, "loaded slot")
                    template[slot] = np.array(value, dtype=spec.dtype, copy=True)
            fresh[key] = template
        for key, value in values.items():
            np.copyto(self.values[key], value, casting="unsafe")
        self.slots.update(fresh)
        for key in self.slots:
            self._measure(key)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values.values()) + sum(
            t.nbytes for t in self.tables.values()
        )

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, dict], dict[str, TableState]]:
        """Copies of (variables, optimizer slots, tables), for a checkpoint."""
        return (
            {k: v.copy() for k, v in self.values.items()},
            {k: _copy_slots(s) for k, s in self.slots.items()},
            {k: t.export() for k, t in self.tables.items()},
        )

    @staticmethod
    def restored(
        job: Job,
        values: Mapping[str, np.ndarray],
        slots: Mapping[str, dict],
        tables: Mapping[str, TableState],
    ) -> Variables:
        """The state a checkpoint holds, checked against its own job.

        Raises:
            InvalidRequestError: the state does not match its job.
        """
        job.check_values(values)
        specs = {v.key: v.table for v in job.variables if v.table is not None}
        if set(specs) != set(tables):
            raise InvalidRequestError(
                f"the state holds tables {sorted(tables)}, its job declares {sorted(specs)}"
            )
        out = Variables()
        out.tables = {
            k: RowStore.restore(spec, job.optimizer_of(k), tables[k]) for k, spec in specs.items()
        }
        out.values = {k: np.array(v, copy=True) for k, v in values.items()}
        out.slots = {k: _copy_slots(s) for k, s in slots.items()}
        for key in out.slots:
            out._measure(key)
        return out


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray)


def _owned(array: np.ndarray, dtype: str, take: bool) -> np.ndarray:
    """``array`` itself if it may be kept (handed over, writable, C-contiguous, the variable's
    dtype), else a copy."""
    keep = take and array.flags.writeable and array.flags.c_contiguous
    if keep and array.dtype == np.dtype(dtype):
        return array
    return np.array(array, dtype=np.dtype(dtype), copy=True)


def _copy(value: Any) -> Any:
    return value.copy() if isinstance(value, np.ndarray) else value


def _copy_slots(slots: dict) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in slots.items()}


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same array of bytes (two views of one tensor's
    memory): the same start, shape, strides and dtype."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
    )
