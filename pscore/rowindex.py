"""A dynamic table's id -> row index with least-recently-used order, over whole id arrays.

Lookups and inserts are bulk dict calls driven from C (``map(index.get, ...)``,
``dict.update(zip(...))``), never a Python loop per id. Recency is a stamp per row; the order
rows were stamped in is an append-only log, so the least recently used row is the oldest log
entry whose stamp is still its row's: eviction reads the log's head, in order, as an
``OrderedDict`` would pop it.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

_MIN_LOG = 1024  # the log's smallest buffers, and the least it reads at a time to evict


class RowIndex:
    """Maps int64 ids to rows ``0..size-1`` of a store's arrays, in least-recently-used order.

    Within one ``locate`` call the ids it held are touched in the order of their last
    occurrence, then the ids it makes are added in the order of their first occurrence: the
    order an ``OrderedDict`` gets from ``move_to_end`` for each id, then an append for each new
    one. Freed rows (evicted) are reused by later ``locate`` calls.
    """

    def __init__(self, size: int = 16) -> None:
        self._rows: dict[int, int] = {}
        self.ids = np.zeros(size, dtype=np.int64)  # the id each row holds
        self._stamp = np.full(size, -1, dtype=np.int64)  # a row's last touch; -1: free
        self._free = np.arange(size - 1, -1, -1, dtype=np.int64)  # a stack: pop the end
        self._nfree = size
        # The log: (row, stamp) in stamp order, entries [head, tail) of two buffers.
        self._log_rows = np.empty(_MIN_LOG, dtype=np.int64)
        self._log_stamps = np.empty(_MIN_LOG, dtype=np.int64)
        self._head = self._tail = 0
        self._clock = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def size(self) -> int:
        """Rows the store's arrays must have (held and free)."""
        return len(self.ids)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the row of each id, the positions in ``ids`` of the first occurrence of each id
        not held before, whose rows are new); touches every id. ``size`` may grow: the
        caller grows its arrays to it."""
        n = len(ids)
        rows = np.fromiter(map(self._rows.get, ids.tolist(), repeat(-1)), dtype=np.int64, count=n)
        missing = np.flatnonzero(rows < 0)
        held = np.flatnonzero(rows >= 0)
        # Held rows: stamped by their last occurrence (positions increase, so the last).
        touched = rows[held]
        last = len(held) - 1 - np.unique(touched[::-1], return_index=True)[1]
        order = np.sort(last)
        stamp_rows, stamps = [touched[order]], [self._clock + held[order]]
        first = np.empty(0, dtype=np.int64)
        if len(missing):
            keys = ids[missing]
            _, first_of, inverse = np.unique(keys, return_index=True, return_inverse=True)
            by_first = np.argsort(first_of, kind="stable")  # new ids in first-occurrence order
            made = self._take_free(len(first_of))
            row_of_unique = np.empty(len(first_of), dtype=np.int64)
            row_of_unique[by_first] = made
            rows[missing] = row_of_unique[inverse.reshape(-1)]
            first = missing[first_of[by_first]]
            new_ids = ids[first]
            self.ids[made] = new_ids
            self._rows.update(zip(new_ids.tolist(), made.tolist(), strict=True))
            stamp_rows.append(made)
            stamps.append(self._clock + n + first)
        self._clock += 2 * n
        logged_rows, logged = np.concatenate(stamp_rows), np.concatenate(stamps)
        self._stamp[logged_rows] = logged
        self._append(logged_rows, logged)
        return rows, first

    def evict(self, count: int) -> np.ndarray:
        """Drops the ``count`` least recently used rows; returns them (oldest first)."""
        if count <= 0:
            return np.empty(0, dtype=np.int64)
        gone: list[np.ndarray] = []
        need, head = count, self._head
        while need > 0 and head < self._tail:
            end = min(self._tail, head + max(2 * need, _MIN_LOG))
            rows, stamps = self._log_rows[head:end], self._log_stamps[head:end]
            live = np.flatnonzero(self._stamp[rows] == stamps)[:need]
            gone.append(rows[live])
            need -= len(live)
            head = head + int(live[-1]) + 1 if need == 0 else end
        self._head = head
        out = np.concatenate(gone) if gone else np.empty(0, dtype=np.int64)
        list(map(self._rows.__delitem__, self.ids[out].tolist()))
        self._stamp[out] = -1
        self._give_back(out)
        return out

    def order(self) -> np.ndarray:
        """The held rows, least recently used first."""
        rows = self._log_rows[self._head : self._tail]
        return rows[self._stamp[rows] == self._log_stamps[self._head : self._tail]]

    @classmethod
    def holding(cls, ids: np.ndarray) -> RowIndex:
        """An index holding ``ids`` in rows ``0..len-1``, least recently used first."""
        index = cls(max(len(ids), 1))
        n = len(ids)
        index.ids[:n] = ids
        index._rows = dict(zip(ids.tolist(), range(n), strict=True))
        index._stamp[:n] = np.arange(n)
        index._free = np.arange(len(index.ids) - 1, n - 1, -1, dtype=np.int64)
        index._nfree = len(index._free)
        index._append(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64))
        index._clock = n
        return index

    # -- internals --------------------------------------------------------------------------

    def _take_free(self, count: int) -> np.ndarray:
        if count > self._nfree:
            self._grow(len(self.ids) + count - self._nfree)
        start = self._nfree - count
        made = self._free[start : self._nfree][::-1].copy()
        self._nfree = start
        return made

    def _give_back(self, rows: np.ndarray) -> None:
        end = self._nfree + len(rows)
        if end > len(self._free):
            self._free = np.concatenate((self._free[: self._nfree], np.empty_like(rows)))
        self._free[self._nfree : end] = rows[::-1]
        self._nfree = end

    def _grow(self, at_least: int) -> None:
        old = len(self.ids)
        size = max(at_least, 2 * old)
        self.ids = np.concatenate((self.ids, np.zeros(size - old, dtype=np.int64)))
        self._stamp = np.concatenate((self._stamp, np.full(size - old, -1, dtype=np.int64)))
        fresh = np.arange(size - 1, old - 1, -1, dtype=np.int64)
        self._free = np.concatenate((fresh, self._free[: self._nfree]))
        self._nfree = len(self._free)

    def _append(self, rows: np.ndarray, stamps: np.ndarray) -> None:
        """Adds log entries; when the buffers are full, drops the stale entries first, and
        grows them to twice what is then live (so each entry is moved O(1) times)."""
        k = len(rows)
        if self._tail + k > len(self._log_rows):
            held = self._log_rows[self._head : self._tail]
            stamps_held = self._log_stamps[self._head : self._tail]
            live = self._stamp[held] == stamps_held
            kept_rows, kept_stamps = held[live], stamps_held[live]
            size = max(len(self._log_rows), 2 * (len(kept_rows) + k), _MIN_LOG)
            self._log_rows = np.empty(size, dtype=np.int64)
            self._log_stamps = np.empty(size, dtype=np.int64)
            self._head, self._tail = 0, len(kept_rows)
            self._log_rows[: self._tail] = kept_rows
            self._log_stamps[: self._tail] = kept_stamps
        self._log_rows[self._tail : self._tail + k] = rows
        self._log_stamps[self._tail : self._tail + k] = stamps
        self._tail += k
