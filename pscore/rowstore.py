"""Row storage of one shard's slice of an embedding table, and the sparse optimizer step.

Used by the shards and by ``local`` mode alike, so both train rows the same way. Every call
works on whole id arrays with numpy (no Python loop per row): a step gathers its rows and
their optimizer slots into scratch arrays, runs the dense optimizer's math on them, checks the
result and only then scatters it back.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pscore.checks import all_finite
from pscore.optim import Optimizer
from pscore.rowindex import RowIndex
from pscore.tables import TableSlice, init_rows, scatter_rows, sum_duplicates
from pswire.errors import InvalidRequestError

# Arrays at least this large are reserved as anonymous memory in 4 KiB pages (see _reserve).
_RESERVE_MIN_BYTES = 1 << 22


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

    Fixed slices are one array reserved at creation and filled row by row as rows are first
    touched: a large table costs memory only as it is used (in 4 KiB pages; an export fills
    the rest). Dynamic slices map ids to rows (``RowIndex``) of arrays that grow by doubling;
    with a capacity, the least recently touched rows (pulled or pushed) are evicted and
    counted, and come back re-initialised if touched again.
    """

    def __init__(self, spec: TableSlice, optimizer: Optimizer) -> None:
        spec.check(optimizer)
        self.spec = spec
        self.optimizer = optimizer
        self.evictions = 0
        self._index = RowIndex() if spec.dynamic else None
        rows = self._index.size if self._index is not None else spec.local_rows
        # Fixed: reserved, not touched (the OS backs pages as rows are made); dynamic: small.
        self.values = _reserve((rows, spec.dim), spec.dtype)
        self._made = np.zeros(0 if spec.dynamic else rows, dtype=bool)  # fixed rows drawn
        kinds = self.optimizer.make_state(self.values[:0])
        self.slots = {
            k: _reserve(self.values.shape, spec.dtype)
            if v is None or isinstance(v, np.ndarray)
            else v
            for k, v in kinds.items()
        }
        self._scratch: dict[str, np.ndarray] = {}

    @property
    def rows(self) -> int:
        return len(self._index) if self._index is not None else self.spec.local_rows

    @property
    def nbytes(self) -> int:
        arrays = [self.values, *(v for v in self.slots.values() if isinstance(v, np.ndarray))]
        return self.rows * sum(a.itemsize * self.spec.dim for a in arrays)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Copies of rows ``ids`` (checked), creating rows on first touch."""
        rows = self._locate(ids)  # first: it may grow (replace) the arrays
        return np.take(self.values, rows, axis=0, mode="clip")  # in range: checked

    def apply(self, ids: np.ndarray, grad: np.ndarray, optimizer: Optimizer | None = None) -> bool:
        """One optimizer step on the touched rows (duplicates summed); others are untouched.
        Returns False, changing no row or slot, when the result (rows or optimizer state)
        would not be finite.

        ``optimizer``: this update's hyper-parameters (a scheduler's lr, ...), with the slots
        of the one the store was made with; None: that one."""
        store = self.step(ids, grad, optimizer)
        if store is None:
            return False
        store()
        return True

    def step(
        self, ids: np.ndarray, grad: np.ndarray, optimizer: Optimizer | None = None
    ) -> Callable[[], None] | None:
        """``apply`` in two halves: computes the step, changing no row or slot, and returns
        the call that stores it (to be made before this store's next step), or None when the
        result would not be finite. So an update of several variables stores nothing until
        every part of it is known to be finite."""
        ids, grad = sum_duplicates(ids, grad)
        rows = self._locate(ids)
        if not len(rows):
            return _nothing
        part = self._gathered("values", self.values, rows)
        sub = {
            k: self._gathered(k, v, rows) if isinstance(v, np.ndarray) else v
            for k, v in self.slots.items()
        }
        # In cache-sized pieces, the results measured as they are made (optim.py): a finite
        # measure proves every result finite; else each is checked exactly.
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite results: refused
            squares = (optimizer or self.optimizer).apply_blocked(
                part, np.asarray(grad, self.values.dtype), sub, measure=True
            )
        arrays = [part, *(v for v in sub.values() if isinstance(v, np.ndarray))]
        proven = squares is not None and bool(np.isfinite(squares))
        if not proven and not all(all_finite(a) for a in arrays):
            return None

        def store() -> None:
            scatter_rows(self.values, rows, part)
            for key, value in sub.items():
                if isinstance(self.slots[key], np.ndarray):
                    scatter_rows(self.slots[key], rows, value)
                else:
                    self.slots[key] = value

        return store

    def export(self) -> TableState:
        if self._index is None:
            if not self._made.all():
                self._locate(np.arange(self.spec.row_start, self.spec.row_end, dtype=np.int64))
            slots = {k: _take(v, slice(None)) for k, v in self.slots.items()}
            return TableState(None, self.values.copy(), slots, self.evictions)
        rows = self._index.order()
        slots = {k: _take(v, rows) for k, v in self.slots.items()}
        return TableState(self._index.ids[rows], self.values[rows], slots, self.evictions)

    @classmethod
    def restore(cls, spec: TableSlice, optimizer: Optimizer, state: TableState) -> RowStore:
        """A store holding ``state``.

        Raises:
            InvalidRequestError: the state does not fit the slice.
        """
        store = cls.__new__(cls)
        spec.check(optimizer)
        store.spec, store.optimizer, store.evictions = spec, optimizer, state.evictions
        store._scratch = {}
        expected = len(state.ids) if spec.dynamic and state.ids is not None else spec.local_rows
        if state.values.shape != (expected, spec.dim) or (spec.dynamic and state.ids is None):
            raise InvalidRequestError(
                f"table '{spec.key}': saved rows have shape {state.values.shape}, expected "
                f"({expected}, {spec.dim})"
            )
        store.values = np.array(state.values, dtype=spec.dtype, copy=True)
        store._made = np.ones(0 if spec.dynamic else len(store.values), dtype=bool)
        store.slots = {k: _take(v, slice(None)) for k, v in state.slots.items()}
        store._index = None
        if spec.dynamic:
            assert state.ids is not None
            store._index = RowIndex.holding(np.asarray(state.ids, dtype=np.int64))
            store._grow(store._index.size)
        return store

    # -- internals --------------------------------------------------------------------------

    def _fresh(self, ids: np.ndarray) -> np.ndarray:
        s = self.spec
        return init_rows(ids, s.dim, s.dtype, s.init, s.init_scale, s.seed)

    def _start(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """Draws rows ``rows`` for ids ``ids`` and starts their optimizer state."""
        self.values[rows] = fresh = self._fresh(ids)
        # Arrays where the dense optimizer makes them lazily (SGD's momentum buffer): a row's
        # buffer starts at zero, so its first step equals torch's buf = grad (dampening 0).
        for k, v in self.optimizer.make_state(fresh).items():
            if isinstance(self.slots.get(k), np.ndarray):
                self.slots[k][rows] = 0 if v is None else v

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        if self._index is None:
            rows = ids - self.spec.row_start if self.spec.row_start else ids
            if len(rows) and (rows.min() < 0 or rows.max() >= self.spec.local_rows):
                raise InvalidRequestError(
                    f"table '{self.spec.key}': ids outside [{self.spec.row_start}, "
                    f"{self.spec.row_end}) reached its rows"
                )
            made = self._made[rows]
            if not made.all():  # first touch: draw the rows, start their optimizer state
                first = np.unique(rows[~made])
                self._start(first, first + self.spec.row_start)
                self._made[first] = True
            return rows
        rows, first = self._index.locate(ids)
        self._grow(self._index.size)
        if len(first):
            self._start(rows[first], ids[first])
        over = len(self._index) - self.spec.capacity
        if self.spec.capacity and over > 0:
            self.evictions += len(self._index.evict(over))
        return rows

    def _grow(self, size: int) -> None:
        if size <= len(self.values):
            return
        self.values = _resized(self.values, size)
        self.slots = {
            k: _resized(v, size) if isinstance(v, np.ndarray) else v for k, v in self.slots.items()
        }

    def _gathered(self, key: str, array: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of ``array`` copied into this store's scratch array for ``key``
        (reused: a step allocates no row-sized arrays of its own)."""
        buffer = self._scratch.get(key)
        if buffer is None or len(buffer) < len(rows) or buffer.dtype != array.dtype:
            buffer = np.empty((max(len(rows), 16), *array.shape[1:]), dtype=array.dtype)
            self._scratch[key] = buffer
        out = buffer[: len(rows)]
        np.take(array, rows, axis=0, out=out, mode="clip")  # in range: checked
        return out


def _reserve(shape: tuple[int, int], dtype: str) -> np.ndarray:
    """Zeros that cost memory only where rows are written. Large ones are anonymous memory the
    kernel maps on first touch, in 4 KiB pages: numpy asks for 2 MiB pages for large arrays,
    and then the first touch of a row zeroes (and commits) 2 MiB, so a batch of random rows
    commits most of a table (bench/NOTES.md 20)."""
    nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
    if nbytes < _RESERVE_MIN_BYTES:
        return np.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes)
    with contextlib.suppress(AttributeError, OSError):  # no such advice off Linux
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype=dtype).reshape(shape)


def _resized(array: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    out[: len(array)] = array
    return out


def _take(value: Any, index: Any) -> Any:
    return value[index].copy() if isinstance(value, np.ndarray) else value


def _nothing() -> None:
    """The store of a step that touched no row."""
