"""Row storage of one shard's slice of an embedding table, and the sparse optimizer step.

Used by the shards and by ``local`` mode alike, so both train rows the same way. Every call
works on whole id arrays with numpy (no Python loop per row): a step gathers its rows and
their optimizer slots into scratch arrays, runs the dense optimizer's math on them, checks the
result and only then scatters it back.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pscore.checks import all_finite
from pscore.optim import Optimizer, run_pieces, scratch
from pscore.rowindex import RowIndex
from pscore.tables import (
    RowSparse,
    TableSlice,
    gather_rows,
    init_rows,
    row_items,
    rows_from_file,
    sum_duplicates,
)
from pswire.errors import InvalidRequestError

# Arrays at least this large are reserved as anonymous memory in 4 KiB pages (see _reserve).
_RESERVE_MIN_BYTES = 1 << 22
# A row step's piece: 128 KiB of rows (512 of 64 float32). Gathered, stepped and stored while
# in a core's cache: 4,096 x 64 took 589-703 us a step in 512-row pieces, 741-961 in 1,024,
# 739-825 in 256 (an interleaved A/B, bench/NOTES.md 25).
_PIECE_BYTES = 1 << 17
# The thread's scratch blocks a row step's working rows use (pscore.optim.scratch): those
# below are the optimizers' own intermediates.
_WORK = 8


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

    Fixed slices are one array reserved at creation and filled in the order rows are first
    touched (``_slot``: each id's row there, plus one; 0 for an id not touched yet): a large
    table costs memory only as it is used, and a batch of new rows fills whole pages in turn
    instead of faulting in one page per row (an export fills the rest). Dynamic slices map ids
    to rows (``RowIndex``) of arrays that grow by doubling;
    with a capacity, the least recently touched rows (pulled or pushed) are evicted and
    counted, and come back re-initialised if touched again.
    """

    def __init__(
        self, spec: TableSlice, optimizer: Optimizer, place: tuple[int, int] = (0, 1)
    ) -> None:
        """``place``: (this shard, of how many), which picks a dynamic table's rows from its
        ``init_from`` file (``pscore.tables.rows_from_file``).

        Raises:
            InvalidRequestError: a bad slice, or an ``init_from`` file that cannot be its rows.
        """
        spec.check(optimizer)
        self.spec = spec
        self.optimizer = optimizer
        self.evictions = 0
        self._index = RowIndex() if spec.dynamic else None
        rows = self._index.size if self._index is not None else spec.local_rows
        # Fixed: reserved, not touched (the OS backs pages as rows are made); dynamic: small.
        self.values = _reserve((rows, spec.dim), spec.dtype)
        self._slot = _reserve((0 if spec.dynamic else rows,), _slot_dtype(rows))
        self._made = 0  # fixed rows drawn so far: they are values[:_made]
        kinds = self.optimizer.make_state(self.values[:0])
        self.slots = {
            k: _reserve(self.values.shape, spec.dtype)
            if v is None or isinstance(v, np.ndarray)
            else v
            for k, v in kinds.items()
        }
        self._scratch: dict[str, np.ndarray] = {}
        if spec.init_from:  # the file's rows now: nothing later depends on it
            ids, held, state = rows_from_file(spec, *place, optimizer=optimizer)
            if self._index is None:
                self.values[:] = held
                self._slot[:] = np.arange(1, rows + 1, dtype=self._slot.dtype)
                self._made = rows
            else:  # least recently used first, as the file lists them
                assert ids is not None
                self._index = RowIndex.holding(ids)
                self._grow(self._index.size)
                self.values[: len(held)] = held
            self._start_state(slice(0, len(held)))
            for k, v in state.items():  # the file's optimizer state, where it holds it
                if isinstance(v, np.ndarray):
                    self.slots[k][: len(held)] = v
                else:
                    self.slots[k] = v

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
        return gather_rows(self.values, rows)

    def apply(self, ids: np.ndarray, grad: np.ndarray, optimizer: Optimizer | None = None) -> bool:
        """One optimizer step on the touched rows (duplicates summed); others are untouched.
        Returns False, changing no row or slot, when the result (rows or optimizer state)
        would not be finite.

        ``optimizer``: this update's hyper-parameters (a scheduler's lr, ...), with the slots
        of the one the store was made with; None: that one."""
        return self.step(ids, grad, optimizer) is not None

    def step(
        self, ids: np.ndarray, grad: np.ndarray, optimizer: Optimizer | None = None
    ) -> Callable[[], None] | None:
        """``apply``, undoably: returns the call that puts every row and slot back as they
        were (to be made before this store's next step, if at all), or None when the result
        would not be finite (then nothing changed). So an update of several variables
        changes nothing when any part of it is refused.

        The step runs in cache-sized pieces of rows: each piece is gathered (its old rows
        kept), stepped, measured and stored while it is in cache, where gathering every row,
        stepping them all and storing them after took each row through memory three times
        more (bench/NOTES.md 25). A piece whose result is not finite puts back every piece
        stored before it."""
        ids, grad = sum_duplicates(ids, grad)
        rows = self._locate(ids)
        optimizer = optimizer or self.optimizer
        grad = np.asarray(grad, self.values.dtype)
        arrays = {"values": self.values}
        arrays.update((k, v) for k, v in self.slots.items() if isinstance(v, np.ndarray))
        scalars = {k: v for k, v in self.slots.items() if not isinstance(v, np.ndarray)}
        kept = {k: self._kept(k, a, len(rows)) for k, a in arrays.items()}
        size = max(1, _PIECE_BYTES // (self.spec.dim * self.values.itemsize))  # rows a piece
        # No row here is one empty piece: the table's step count (Adam's) moves all the same.
        starts = range(0, max(len(rows), 1), size)
        # Each array as one item per row: a row moves as one block of bytes.
        whole = {k: row_items(a) for k, a in arrays.items()}
        old = {k: row_items(a) for k, a in kept.items()}

        def run(first: int, last: int) -> tuple[dict[str, Any], slice, bool]:
            """Pieces ``first`` to ``last`` in turn: (the scalar slots after, the rows
            stored, whether every piece was finite: the first that is not ends the run)."""
            after, begin = scalars, starts[first]
            with np.errstate(over="ignore", invalid="ignore"):  # non-finite results: refused
                for start in starts[first:last]:
                    part = slice(start, start + size)
                    at = rows[part]
                    work = {}
                    for index, key in enumerate(arrays):
                        np.take(whole[key], at, out=old[key][part], mode="clip")
                        work[key] = rows_now = scratch(kept[key][part], _WORK + index)
                        np.copyto(rows_now, kept[key][part])
                    sub = {**scalars, **work}
                    optimizer.apply(sub.pop("values"), grad[part], sub)
                    if not all(map(_finite, work.values())):
                        return after, slice(begin, start), False
                    for key, rows_now in work.items():
                        whole[key][at] = row_items(rows_now)
                    after = {k: sub[k] for k in scalars}
            return after, slice(begin, min(starts[last - 1] + size, len(rows))), True

        done = run_pieces(len(starts), run)
        stored = [span for _, span, _ in done]

        def undo() -> None:
            for span in stored:
                for key, items in whole.items():
                    items[rows[span]] = old[key][span]
            self.slots.update(scalars)

        if not all(finite for _, _, finite in done):
            undo()
            return None
        self.slots.update(done[-1][0])
        return undo

    def held(self) -> RowSparse:
        """Copies of every row a dynamic slice holds, least recently used first, with their
        ids; touches none (``psctl export``)."""
        assert self._index is not None, "a fixed slice: its rows by id range"
        rows = self._index.order()
        return RowSparse(self._index.ids[rows], self.values[rows])

    def state_of(self, ids: np.ndarray | None) -> dict[str, Any]:
        """Copies of the optimizer state of rows ``ids``, located as ``gather`` locates them
        (None: of every row a dynamic slice holds, in ``held``'s order, touching none), counts
        as they are (``psctl export``)."""
        if ids is None and self._index is not None:
            return self._state_at(self._index.order())
        return self._state_at(self._locate(np.asarray(ids, dtype=np.int64)))

    def export(self) -> TableState:
        if self._index is None:  # every row, in id order
            rows = self._locate(np.arange(self.spec.row_start, self.spec.row_end, dtype=np.int64))
            state = self._state_at(rows)
            return TableState(None, gather_rows(self.values, rows), state, self.evictions)
        rows = self._index.order()
        state = self._state_at(rows)
        return TableState(self._index.ids[rows], self.values[rows], state, self.evictions)

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
        fixed = 0 if spec.dynamic else len(store.values)  # held in id order
        store._slot = np.arange(1, fixed + 1, dtype=_slot_dtype(fixed))
        store._made = fixed
        store.slots = {k: _take(v, slice(None)) for k, v in state.slots.items()}
        store._index = None
        if spec.dynamic:
            assert state.ids is not None
            store._index = RowIndex.holding(np.asarray(state.ids, dtype=np.int64))
            store._grow(store._index.size)
        return store

    # -- internals --------------------------------------------------------------------------

    def _state_at(self, rows: np.ndarray) -> dict[str, Any]:
        """Copies of the optimizer slots of store rows ``rows``; counts as they are."""
        return {k: _take(v, rows) for k, v in self.slots.items()}

    def _start(self, rows: np.ndarray | slice, ids: np.ndarray) -> None:
        """Draws rows ``rows`` for ids ``ids`` and starts their optimizer state."""
        s = self.spec
        if isinstance(rows, slice):  # contiguous: drawn in place
            init_rows(ids, s.dim, s.dtype, s.init, s.init_scale, s.seed, out=self.values[rows])
        else:
            self.values[rows] = init_rows(ids, s.dim, s.dtype, s.init, s.init_scale, s.seed)
        self._start_state(rows)

    def _start_state(self, rows: np.ndarray | slice) -> None:
        """Starts the optimizer state of rows ``rows``."""
        # Arrays where the dense optimizer makes them lazily (SGD's momentum buffer): a row's
        # buffer starts at zero, so its first step equals torch's buf = grad (dampening 0).
        for k, v in self.optimizer.make_state(self.values[:1]).items():
            if isinstance(self.slots.get(k), np.ndarray):
                self.slots[k][rows] = 0 if v is None else v

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        if self._index is None:
            local = ids - self.spec.row_start if self.spec.row_start else ids
            if len(local) and (local.min() < 0 or local.max() >= self.spec.local_rows):
                raise InvalidRequestError(
                    f"table '{self.spec.key}': ids outside [{self.spec.row_start}, "
                    f"{self.spec.row_end}) reached its rows"
                )
            slots = self._slot[local]
            if not slots.all():  # first touch: draw the rows, start their optimizer state
                first = local[slots == 0]
                if len(first) > 1 and not (first[1:] > first[:-1]).all():
                    first = np.unique(first)  # not sorted, or an id twice
                made = self._made + len(first)
                self._slot[first] = np.arange(self._made + 1, made + 1, dtype=self._slot.dtype)
                self._start(slice(self._made, made), first + self.spec.row_start)
                self._made = made
                slots = self._slot[local]
            return slots.astype(np.intp) - 1
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

    def _kept(self, key: str, array: np.ndarray, count: int) -> np.ndarray:
        """This store's scratch array for ``key``'s old rows in a step, ``count`` rows like
        ``array``'s (reused: a step allocates no row-sized arrays of its own)."""
        buffer = self._scratch.get(key)
        if buffer is None or len(buffer) < count or buffer.dtype != array.dtype:
            buffer = np.empty((max(count, 16), *array.shape[1:]), dtype=array.dtype)
            self._scratch[key] = buffer
        return buffer[:count]


def _slot_dtype(rows: int) -> type:
    return np.int32 if rows < 2**31 - 1 else np.int64


def _reserve(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeros that cost memory only where rows are written. Large ones are anonymous memory the
    kernel maps on first touch, in 4 KiB pages: numpy asks for 2 MiB pages for large arrays,
    and then the first touch of a row zeroes (and commits) 2 MiB, so a batch of random rows
    commits most of a table (bench/NOTES.md 20)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
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


def _finite(array: np.ndarray) -> bool:
    """Whether a piece's result is finite (numpy's errors ignored by the caller): its sum of
    squares proves it when finite (one pass in cache), else the exact check decides (finite
    values can overflow the sum)."""
    flat = array.reshape(-1)
    return bool(np.isfinite(np.dot(flat, flat))) or all_finite(array)
