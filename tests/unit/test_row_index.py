"""Row storage over whole id arrays: the dynamic index keeps an OrderedDict's least-recently-
used order, a non-finite step changes nothing, a fixed table commits only rows it touched."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pscore.optim import SGD, Adagrad
from pscore.rowindex import RowIndex
from pscore.rowstore import RowStore
from pscore.tables import TableSlice, init_rows


class Reference:
    """The rule as a Python loop over an OrderedDict (the store's code before issue 20): held
    ids move to the end one by one, then new ids are appended, then the oldest are evicted."""

    def __init__(self, capacity: int) -> None:
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.evictions = 0

    def touch(self, ids: list[int]) -> None:
        new = []
        for key in ids:
            if key in self.lru:
                self.lru.move_to_end(key)
            else:
                new.append(key)
        for key in new:
            if key not in self.lru:
                self.lru[key] = None
        while self.capacity and len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
            self.evictions += 1


batches = st.lists(st.lists(st.integers(-6, 30), max_size=12), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(batches=batches, capacity=st.integers(0, 12), restore_at=st.integers(0, 25))
def test_index_order_and_evictions_match_an_ordered_dict(batches, capacity, restore_at):
    reference = Reference(capacity)
    index = RowIndex(4)
    evictions = 0
    for turn, batch in enumerate(batches):
        if turn == restore_at:  # a checkpoint's restore keeps the order
            index = RowIndex.holding(index.ids[index.order()])
        ids = np.array(batch, dtype=np.int64)
        rows, first = index.locate(ids)
        # Every id maps to the row that holds it; new ids are those not held before.
        assert index.ids[rows].tolist() == batch
        assert sorted(ids[first].tolist()) == sorted(set(batch) - set(reference.lru))
        over = len(index) - capacity
        if capacity and over > 0:
            evictions += len(index.evict(over))
        reference.touch(batch)
        assert index.ids[index.order()].tolist() == list(reference.lru)
        assert len(index) == len(reference.lru) and evictions == reference.evictions
        assert len(set(index.order().tolist())) == len(index)  # each held row once


def test_a_dynamic_store_evicts_the_least_recently_used_and_redraws_them():
    spec = TableSlice("h", 2, capacity=3, init="uniform", seed=3)
    store = RowStore(spec, SGD(lr=1.0))
    store.gather(np.array([10, 20, 30]))
    assert store.apply(np.array([20]), np.ones((1, 2), np.float32))
    store.gather(np.array([10, 40]))  # 30 is now the least recently used, then 20
    assert store.evictions == 1 and store.rows == 3
    state = store.export()
    assert state.ids is not None and state.ids.tolist() == [20, 10, 40]
    seeded = init_rows(np.array([20, 30]), 2, "float32", "uniform", 1.0, 3)
    assert np.array_equal(state.values[0], seeded[0] - 1.0)
    again = store.gather(np.array([30]))  # made anew from the seed; 20 goes
    assert np.array_equal(again[0], seeded[1]) and store.evictions == 2


def test_a_table_step_whose_result_is_not_finite_changes_nothing():
    spec = TableSlice("t", 3, num_rows=4, row_start=0, row_end=4, init="uniform")
    store = RowStore(spec, Adagrad(lr=0.1))
    before = store.gather(np.arange(4)).copy()
    sums = store.slots["sum"].copy()
    huge = np.full((2, 3), 1e30, np.float32)  # its square overflows Adagrad's sum
    assert not store.apply(np.array([1, 2]), huge)
    assert np.array_equal(store.gather(np.arange(4)), before)
    assert np.array_equal(store.slots["sum"], sums) and store.slots["step"] == 0
    assert store.apply(np.array([1, 2]), np.ones((2, 3), np.float32))
    assert store.slots["step"] == 1 and not np.array_equal(store.gather(np.arange(4)), before)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's RSS")
def test_a_fixed_table_costs_memory_only_for_the_rows_it_touched():
    rows = 1 << 21  # x 64 float32: 512 MiB of rows and as much of Adagrad's sums
    spec = TableSlice("t", 64, num_rows=rows, row_start=0, row_end=rows, init="uniform")
    before = _rss()
    store = RowStore(spec, Adagrad(lr=0.1))
    ids = np.random.default_rng(0).choice(rows, 2000, replace=False)
    store.apply(ids, np.ones((len(ids), 64), np.float32))
    grown = _rss() - before
    # 2000 rows touched in 4 KiB pages: ~16 MiB at most; 2 MiB pages or slots written in full
    # at creation would commit hundreds of MiB.
    assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
    expected = init_rows(ids[:3], 64, "float32", "uniform", 1.0, 0)
    Adagrad(lr=0.1).apply(expected, np.ones_like(expected), Adagrad(lr=0.1).make_state(expected))
    assert np.array_equal(store.gather(ids[:3]), expected)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
