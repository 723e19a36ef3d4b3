"""psworker.shard of a DataLoader keeps what the user set: its own sampler or batch sampler
(split among workers, not replaced), and every DataLoader setting; its length per worker;
per-worker seeds (``psworker.seed``)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import (  # noqa: E402
    BatchSampler,
    DataLoader,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import psworker  # noqa: E402
from pswire.errors import ConfigError  # noqa: E402

N = 50


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N).float(), torch.arange(N))


def workers(n: int = 2) -> list[SimpleNamespace]:
    return [SimpleNamespace(worker_id=w, num_workers=n) for w in range(n)]


def test_a_batch_sampler_keeps_its_batches_split_among_workers():
    # Issue 27 item 12: the loader was rebuilt with batch_size None: unbatched samples.
    ds = dataset()
    loader = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 5, drop_last=False))
    parts = [list(psworker.shard(loader, c)) for c in workers()]
    for part in parts:
        assert len(part) == 5  # 10 batches of 5, dealt out in turn
        assert all(b[1].shape == (5,) for b in part)
    ids = [i for part in parts for b in part for i in b[1].tolist()]
    assert sorted(ids) == list(range(N))  # disjoint, every sample once
    assert parts[0][0][1].tolist() == [0, 1, 2, 3, 4] and parts[1][0][1].tolist() == [5, 6, 7, 8, 9]
    sharded = psworker.shard(loader, workers()[0])
    assert len(sharded) == 5 and sharded.num_samples == 25


def test_a_weighted_sampler_is_split_not_replaced():
    # Issue 27 item 12: a WeightedRandomSampler became a uniform shuffle (samples of weight
    # 0 drawn). Now every worker takes its part of one draw, the same draw on every worker.
    weights = torch.zeros(N)
    weights[[3, 17, 42]] = 1.0
    loader = DataLoader(dataset(), batch_size=4, sampler=WeightedRandomSampler(weights, 32))
    parts = [psworker.shard(loader, c) for c in workers()]
    drawn = [torch.cat([b[1] for b in p]).tolist() for p in parts]
    assert all(len(d) == 16 for d in drawn)
    assert set(drawn[0]) | set(drawn[1]) <= {3, 17, 42}
    assert [p.num_samples for p in parts] == [16, 16]
    assert [len(p) for p in parts] == [4, 4]  # batches of 4
    again = [torch.cat([b[1] for b in p]).tolist() for p in parts]  # the next epoch
    assert again != drawn and set(again[0]) <= {3, 17, 42}
    parts[0].set_epoch(0)
    assert torch.cat([b[1] for b in parts[0]]).tolist() == drawn[0]  # reproducible


def test_a_sampler_that_does_not_divide_is_padded_to_equal_parts():
    loader = DataLoader(dataset(), batch_size=None, sampler=list(range(7)))
    parts = [list(psworker.shard(loader, c)) for c in workers(3)]
    assert [len(p) for p in parts] == [3, 3, 3]  # sync needs equal step counts
    assert sorted(int(x[1]) for p in parts for x in p) == [0, 0, 1, 1, 2, 3, 4, 5, 6]


def shift_rows(worker_id: int) -> None:
    """A worker_init_fn with a visible effect: its loader worker yields every label + 1000."""
    dataset = torch.utils.data.get_worker_info().dataset
    dataset.tensors = (dataset.tensors[0], dataset.tensors[1] + 1000)


def test_every_dataloader_setting_is_kept():
    # Issue 27 item 19: worker_init_fn, persistent_workers, prefetch_factor, timeout, generator
    # and multiprocessing_context were dropped: a loader whose worker_init_fn raises failed
    # when iterated directly but yielded every batch once sharded. (A worker_init_fn that
    # changes the rows shows the same without a failed worker, which torch takes 5 s to stop.)
    marked = DataLoader(dataset(), batch_size=5, num_workers=1, worker_init_fn=shift_rows)
    assert min(min(b[1].tolist()) for b in marked) == 1000
    sharded_labels = [x for b in psworker.shard(marked, workers()[0]) for x in b[1].tolist()]
    assert len(sharded_labels) == N // 2 and min(sharded_labels) >= 1000
    g = torch.Generator().manual_seed(5)
    kept = DataLoader(
        dataset(),
        batch_size=5,
        shuffle=True,
        num_workers=1,
        persistent_workers=True,
        prefetch_factor=3,
        timeout=30.0,
        generator=g,
        multiprocessing_context="fork",
        pin_memory=False,
    )
    sharded = psworker.shard(kept, workers()[1])
    rebuilt = sharded.loader
    for name in ("persistent_workers", "prefetch_factor", "timeout", "generator", "num_workers"):
        assert getattr(rebuilt, name) == getattr(kept, name), name
    assert rebuilt.multiprocessing_context is kept.multiprocessing_context
    first = [b[1].tolist() for b in sharded]
    second = [b[1].tolist() for b in sharded]  # the same persistent loader, the next epoch
    assert sharded.loader is rebuilt and len(first) == len(second) == 5
    assert first != second  # reshuffled each epoch


def test_num_samples_is_this_workers_share_and_dataset_stays_whole():
    loader = DataLoader(dataset(), batch_size=8)
    sharded = psworker.shard(loader, workers()[1])
    assert len(sharded.dataset) == N  # upstream's len(loader.dataset): every worker's
    assert sharded.num_samples == 25 == sum(len(b[1]) for b in sharded)


def test_an_elastic_job_refuses_a_loaders_own_sampler_clearly():
    elastic = SimpleNamespace(
        worker_id=0, num_workers=2, step=0, min_workers=1, max_workers=2, members=lambda s: None
    )
    loader = DataLoader(dataset(), batch_size=4, sampler=WeightedRandomSampler(torch.ones(N), 8))
    with pytest.raises(ConfigError, match=r"sampler \(WeightedRandomSampler\) in an elastic job"):
        psworker.shard(loader, elastic)


def test_seed_gives_each_worker_its_own_reproducible_stream():
    # Issue 27 item 13: with one seed every worker drew the same noise.
    draws = {}
    for client in [*workers(), workers()[0]]:
        value = psworker.seed(7, client)
        assert value == psworker.worker_seed(7, client.worker_id) == 7 + client.worker_id
        draws.setdefault(client.worker_id, []).append(
            (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random())
        )
    assert draws[0][0] == draws[0][1]  # reproducible
    for a, b in zip(draws[0][0], draws[1][0], strict=True):
        assert a != b  # torch, numpy and random each differ between workers
    with pytest.raises(ValueError, match="must be >= 0"):
        psworker.worker_seed(-1, 0)
