"""Row storage of one shard's slice of an embedding table, and the sparse optimizer step.

Used by the shards and by ``local`` mode alike, so both train rows the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from pswire.errors import InvalidRequestError
from pswire.optim import Optimizer
from pswire.tables import TableSlice, init_rows, sum_duplicates


@dataclass(frozen=True)
class TableState:
    """A table slice's contents, for checkpoints: ``ids`` (dynamic: least recently used
    first; None for fixed slices), their rows, optimizer slots, evictions so far."""

    ids: np.ndarray | None
    values: np.ndarray
    slots: dict[str, Any]
    evictions: int


class RowStore:
    """The rows of one table slice and their optimizer state; not thread-safe (the shard
    holds its lock around every call).

    Fixed slices are one dense array reserved at creation and filled row by row as rows are
    first touched (a large table costs memory only as it is used; an export fills the rest).
    Dynamic slices map ids to rows of arrays that grow by doubling; with a capacity, the least
    recently touched rows (pulled or pushed) are evicted and counted, and come back
    re-initialised if touched again.
    """

    def __init__(self, spec: TableSlice, optimizer: Optimizer) -> None:
        spec.check(optimizer)
        self.spec = spec
        self.optimizer = optimizer
        self.evictions = 0
        self._lru: OrderedDict[int, int] = OrderedDict()  # dynamic: id -> row, oldest first
        self._free: list[int] = []
        rows = spec.local_rows if not spec.dynamic else 16
        # Fixed: reserved, not touched (the OS backs pages as rows are made); dynamic: small.
        self.values = (np.zeros if spec.dynamic else np.empty)((rows, spec.dim), spec.dtype)
        self._made = np.zeros(0 if spec.dynamic else rows, dtype=bool)  # fixed rows drawn
        kinds = self.optimizer.make_state(self.values[:0])
        self.slots = {
            k: np.zeros_like(self.values) if v is None or isinstance(v, np.ndarray) else v
            for k, v in kinds.items()
        }

    @property
    def rows(self) -> int:
        return len(self._lru) if self.spec.dynamic else self.spec.local_rows

    @property
    def nbytes(self) -> int:
        arrays = [self.values, *(v for v in self.slots.values() if isinstance(v, np.ndarray))]
        return self.rows * sum(a.itemsize * self.spec.dim for a in arrays)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Copies of rows ``ids`` (checked), creating dynamic rows on first touch."""
        rows = self._locate(ids)  # first: it may grow (replace) the arrays
        return self.values[rows]

    def apply(self, ids: np.ndarray, grad: np.ndarray, optimizer: Optimizer | None = None) -> None:
        """One optimizer step on the touched rows (duplicates summed); others are untouched.

        ``optimizer``: this update's hyper-parameters (a scheduler's lr, ...), with the slots
        of the one the store was made with; None: that one."""
        ids, grad = sum_duplicates(ids, grad)
        rows = self._locate(ids)
        if len(rows):
            (optimizer or self.optimizer).apply_rows(self.values, rows, grad, self.slots)

    def export(self) -> TableState:
        if not self.spec.dynamic and not self._made.all():
            self._locate(np.arange(self.spec.row_start, self.spec.row_end, dtype=np.int64))
        slots = {k: _take(v, slice(None)) for k, v in self.slots.items()}
        if not self.spec.dynamic:
            return TableState(None, self.values.copy(), slots, self.evictions)
        ids = np.fromiter(self._lru.keys(), dtype=np.int64, count=len(self._lru))
        rows = np.fromiter(self._lru.values(), dtype=np.int64, count=len(self._lru))
        slots = {k: _take(v, rows) for k, v in self.slots.items()}
        return TableState(ids, self.values[rows], slots, self.evictions)

    @classmethod
    def restore(cls, spec: TableSlice, optimizer: Optimizer, state: TableState) -> RowStore:
        """A store holding ``state``.

        Raises:
            InvalidRequestError: the state does not fit the slice.
        """
        store = cls.__new__(cls)
        spec.check(optimizer)
        store.spec, store.optimizer, store.evictions = spec, optimizer, state.evictions
        store._free = []
        expected = len(state.ids) if spec.dynamic and state.ids is not None else spec.local_rows
        if state.values.shape != (expected, spec.dim) or (spec.dynamic and state.ids is None):
            raise InvalidRequestError(
                f"table '{spec.key}': saved rows have shape {state.values.shape}, expected "
                f"({expected}, {spec.dim})"
            )
        store.values = np.array(state.values, dtype=spec.dtype, copy=True)
        store._made = np.ones(0 if spec.dynamic else len(store.values), dtype=bool)
        store.slots = {k: _take(v, slice(None)) for k, v in state.slots.items()}
        ids = state.ids if state.ids is not None else np.empty(0, dtype=np.int64)
        store._lru = OrderedDict((int(i), r) for r, i in enumerate(ids))
        return store

    # -- internals --------------------------------------------------------------------------

    def _fresh(self, ids: np.ndarray) -> np.ndarray:
        s = self.spec
        return init_rows(ids, s.dim, s.dtype, s.init, s.init_scale, s.seed)

    def _fresh_slots(self, values: np.ndarray) -> dict[str, Any]:
        # Arrays where the dense optimizer makes them lazily (SGD's momentum buffer): a row's
        # buffer starts at zero, so its first step equals torch's buf = grad (dampening 0).
        made = self.optimizer.make_state(values)
        return {k: np.zeros_like(values) if v is None else v for k, v in made.items()}

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        if not self.spec.dynamic:
            rows = ids - self.spec.row_start
            first = np.unique(rows[~self._made[rows]])
            if len(first):  # first touch: draw the rows, start their optimizer state
                self.values[first] = self._fresh(first + self.spec.row_start)
                for k, v in self._fresh_slots(self.values[first]).items():
                    if isinstance(v, np.ndarray):
                        self.slots[k][first] = v
                self._made[first] = True
            return rows
        rows = np.empty(len(ids), dtype=np.int64)
        new: list[int] = []
        lru = self._lru
        for i, key in enumerate(ids.tolist()):
            row = lru.get(key)
            if row is None:
                new.append(i)
                rows[i] = -1
            else:
                lru.move_to_end(key)
                rows[i] = row
        if new:
            self._create(ids, rows, np.asarray(new, dtype=np.int64))
        return rows

    def _create(self, ids: np.ndarray, rows: np.ndarray, new: np.ndarray) -> None:
        """Makes rows for ``ids[new]``, then evicts the least recently used over capacity."""
        needed = len(new) - len(self._free)
        if needed > 0:
            self._grow(len(self._lru) + len(self._free) + needed)
        for i in new.tolist():
            key = int(ids[i])
            if key in self._lru:  # a repeated new id: the first occurrence made it
                rows[i] = self._lru[key]
                continue
            row = self._free.pop() if self._free else len(self._lru) + len(self._free)
            self._lru[key] = row
            rows[i] = row
        made = rows[new]
        self.values[made] = self._fresh(ids[new])
        fresh = self._fresh_slots(self.values[made])
        for k, v in fresh.items():
            if isinstance(v, np.ndarray):
                self.slots[k][made] = v
        cap = self.spec.capacity
        while cap and len(self._lru) > cap:
            _, row = self._lru.popitem(last=False)
            self._free.append(row)
            self.evictions += 1

    def _grow(self, at_least: int) -> None:
        size = len(self.values)
        if at_least <= size:
            return
        size = max(at_least, 2 * size)
        self.values = _resized(self.values, size)
        self.slots = {
            k: _resized(v, size) if isinstance(v, np.ndarray) else v for k, v in self.slots.items()
        }


def _resized(array: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    out[: len(array)] = array
    return out


def _take(value: Any, index: Any) -> Any:
    return value[index].copy() if isinstance(value, np.ndarray) else value
