"""All-reduce ranks agree on what they apply: ranks built with other optimizer settings, or
whose step hyper-parameters differ (a scheduler stepped differently), raise
HyperParameterMismatchError naming the ranks and values, on every rank, before applying
anything; ranks that agree train as before, with or without 16-bit compression."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from pswire.errors import HyperParameterMismatchError  # noqa: E402
from psworker.ring.ring import RingServer  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

WORLD = 2


def model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Linear(3, 1)
    with torch.no_grad():
        net.weight.copy_(torch.randn(1, 3, generator=g))
        net.bias.zero_()
    return net


def on_ranks(
    body: Callable[[int, psworker.Client, torch.nn.Module], None], compression: str | None = None
) -> tuple[dict[int, BaseException], dict[int, torch.nn.Module]]:
    """Runs ``body(rank, client, model)`` on two real ranks (gRPC rings, one thread each);
    returns each rank's error and model."""
    servers = [RingServer("127.0.0.1:0") for _ in range(WORLD)]
    peers = [s.address for s in servers]
    errors: dict[int, BaseException] = {}
    models = {r: model() for r in range(WORLD)}

    def run(rank: int) -> None:
        try:
            with psworker.connect(
                peers,
                worker_id=rank,
                mode="allreduce",
                server=servers[rank],
                timeout=20,
                compression=compression,
            ) as client:
                body(rank, client, models[rank])
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return errors, models


def step(opt: torch.optim.Optimizer, net: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()


def test_ranks_built_with_other_learning_rates_refuse_the_first_step():
    before: dict[int, torch.Tensor] = {}

    def body(rank: int, client: psworker.Client, net: torch.nn.Module) -> None:
        lr = 0.1 if rank == 0 else 0.5
        opt = DistributedOptimizer(net, client, torch.optim.SGD(net.parameters(), lr=lr))
        before[rank] = net.weight.detach().clone()
        step(opt, net, rank)

    errors, models = on_ranks(body)
    assert sorted(errors) == [0, 1]
    for rank, error in errors.items():
        assert isinstance(error, HyperParameterMismatchError), repr(error)
        text = str(error)
        assert "at step 0: ranks [1] apply other settings than rank 0" in text, text
        assert "group 0 lr: rank 0 0.1, rank 1 0.5" in text, text
        # Nothing was applied: the step was refused before the optimizer ran.
        assert torch.equal(models[rank].weight, before[rank])


def test_a_scheduler_stepped_differently_is_named_at_the_step_it_diverges():
    done: dict[int, int] = {}

    def body(rank: int, client: psworker.Client, net: torch.nn.Module) -> None:
        opt = DistributedOptimizer(
            net, client, torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.9, 0.99))
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for t in range(6):
            step(opt, net, 10 * t + rank)
            done[rank] = t + 1
            sched.step()
            if rank == 1 and t == 2:
                sched.step()  # one step too many on rank 1 only: its lr halves at step 3

    errors, _ = on_ranks(body)
    assert done == {0: 3, 1: 3}, done
    for rank in range(WORLD):
        text = str(errors[rank])
        assert isinstance(errors[rank], HyperParameterMismatchError), repr(errors[rank])
        assert "at step 3" in text and "group 0 lr: rank 0 0.005, rank 1 0.0025" in text, text
        assert "beta" not in text, text  # only what differs is named


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_agreeing_ranks_train_identically(compression):
    def body(rank: int, client: psworker.Client, net: torch.nn.Module) -> None:
        opt = DistributedOptimizer(net, client, torch.optim.SGD(net.parameters(), lr=0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        for t in range(4):
            step(opt, net, 10 * t + rank)
            sched.step()

    errors, models = on_ranks(body, compression)
    assert not errors, errors
    a, b = (m.weight.detach().numpy() for m in models.values())
    assert np.array_equal(a, b)
    assert not np.array_equal(a, model().weight.detach().numpy())  # it trained
