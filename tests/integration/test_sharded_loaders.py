"""A sync job on two shards trained from loaders the user built with a weighted sampler or a
batch sampler: each worker draws only what the sampler allows, both take equal steps, and the
replicas end identical (issue 27 item 12, with real servers)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import (  # noqa: E402
    BatchSampler,
    DataLoader,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

N = 64


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 3, generator=g), torch.arange(N))


def weighted() -> DataLoader:
    weights = torch.zeros(N)
    weights[::8] = 1.0  # 8 samples may be drawn, the other 56 never
    return DataLoader(dataset(), batch_size=4, sampler=WeightedRandomSampler(weights, 40))


def batched() -> DataLoader:
    ds = dataset()
    return DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 6, drop_last=True))


@pytest.mark.parametrize(("make", "steps"), [(weighted, 5), (batched, 5)])
def test_a_users_sampler_trains_a_sync_job_on_two_shards(shards, make: Callable, steps: int):
    addrs = [s.address for s in shards(2)]
    models = [torch.nn.Linear(3, 1) for _ in range(2)]
    drawn: dict[int, list[int]] = {}

    def worker(i: int) -> Callable[[], None]:
        def run() -> None:
            with psworker.connect(addrs, worker_id=i, num_workers=2, mode="sync") as client:
                opt = DistributedOptimizer(
                    models[i], client, torch.optim.SGD(models[i].parameters(), lr=0.1)
                )
                data = psworker.shard(make(), client)
                assert len(data) == steps
                ids: list[int] = []
                for x, index in data:
                    assert x.shape[1:] == (3,) and len(x) > 1  # batches, not single samples
                    opt.zero_grad()
                    models[i](x).pow(2).mean().backward()
                    opt.step()
                    ids += index.tolist()
                assert len(ids) == data.num_samples
                drawn[i] = ids
                assert client.step == steps

        return run

    run_workers([worker(0), worker(1)])
    if make is weighted:
        assert all(i % 8 == 0 for ids in drawn.values() for i in ids)  # weight 0: never drawn
    else:
        assert not set(drawn[0]) & set(drawn[1])  # disjoint batches
    a, b = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(a[k], b[k]) for k in a)  # sync: the shards' weights on both
