"""A script ported from DDP that keeps its ``DistributedDataParallel`` wrapper: its gradients
are averaged by DDP and then by the job. Correct, but twice the traffic, so it is named."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402


@pytest.fixture
def process_group() -> Iterator[None]:
    """A one-rank gloo group over an in-memory store (no port), as torchrun would make."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_model_still_wrapped_in_ddp_is_named_in_a_warning(process_group):
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    with psworker.connect(mode="local") as client:
        with pytest.warns(UserWarning, match="wrapped in DistributedDataParallel.*twice"):
            opt = DistributedOptimizer(ddp, client, torch.optim.SGD(ddp.parameters(), lr=0.1))
        opt.zero_grad()
        ddp(torch.ones(2, 3)).sum().backward()
        opt.step()  # it still trains
        assert client.step == 1


def test_the_model_itself_warns_of_nothing():
    model = torch.nn.Linear(3, 1)
    with psworker.connect(mode="local") as client, warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
