"""psworker.shard: disjoint, deterministic, equal-length slices, reshuffled each epoch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import psworker
from psworker.data import shard_indices


@given(length=st.integers(0, 300), workers=st.integers(1, 9), epoch=st.integers(0, 5))
def test_slices_cover_everything_equally_and_only_padding_repeats(length, workers, epoch):
    slices = [shard_indices(length, w, workers, epoch, seed=3) for w in range(workers)]
    assert len({len(s) for s in slices}) == 1  # equal step counts, which sync mode needs
    joined = np.concatenate(slices)
    assert set(joined.tolist()) == set(range(length))
    assert len(joined) - length < workers  # padding only
    assert np.array_equal(slices[0], shard_indices(length, 0, workers, epoch, seed=3))


def test_epochs_reshuffle_with_the_shared_seed():
    a = shard_indices(100, 0, 2, epoch=0, seed=1)
    b = shard_indices(100, 0, 2, epoch=1, seed=1)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, shard_indices(100, 0, 2, epoch=0, seed=1))
    assert not np.array_equal(a, shard_indices(100, 0, 2, epoch=0, seed=2))
    assert np.array_equal(shard_indices(5, 1, 2, 0, shuffle=False), [1, 3, 0])  # padded


def test_shard_of_a_dataset_yields_items_and_advances_epochs():
    client = SimpleNamespace(worker_id=1, num_workers=3)
    data = list(range(10, 40))
    sharded = psworker.shard(data, client, seed=0)
    first, second = list(sharded), list(sharded)
    assert len(first) == len(second) == 10 == len(sharded)
    assert first != second and sorted(first) != sorted(range(10, 20))
    sharded.set_epoch(0)
    assert list(sharded) == first
    with pytest.raises(ValueError, match="worker_id 3"):
        shard_indices(5, 3, 3, 0)


def test_shard_of_a_loader_keeps_its_batching():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(50).float(), torch.arange(50))
    loader = DataLoader(ds, batch_size=8)
    seen = []
    for worker in range(2):
        sharded = psworker.shard(loader, SimpleNamespace(worker_id=worker, num_workers=2))
        batches = list(sharded)
        assert len(batches) == len(sharded) == 4  # 25 samples -> 8, 8, 8, 1
        assert [len(b[0]) for b in batches] == [8, 8, 8, 1]
        seen.append(torch.cat([b[1] for b in batches]))
    assert set(seen[0].tolist()).isdisjoint(seen[1].tolist())
    assert set(seen[0].tolist()) | set(seen[1].tolist()) == set(range(50))
