"""Parameters in no optimizer group (a frozen backbone, ``SGD(model.head.parameters())``) are
never trained nor sent, so every worker must hold the same values. DDP broadcasts rank 0's at
construction; so does ``allreduce``. The parameter-server modes never send them: a worker
holding others than worker 0's is refused at init, naming them, instead of training its
share of the head on another backbone. A frozen layer that is in the optimizer and unfrozen
later trains as in torch."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import psworker  # noqa: E402
from pswire.errors import ModelMismatchError  # noqa: E402
from psworker.ring.ring import RingServer  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # per worker, as psworker.seed() seeds
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)  # frozen, never given to the optimizer
    return model


def run_two(connect: Any, seeds: tuple[int, int]) -> tuple[dict[int, Any], dict[int, Exception]]:
    states: dict[int, Any] = {}
    errors: dict[int, Exception] = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    models = {i: build(seeds[i]) for i in range(2)}  # torch's global RNG is not for threads

    def worker(i: int) -> None:
        model = models[i]
        try:
            with connect(i) as client:
                opt = DistributedOptimizer(model, client, torch.optim.SGD(model[2].parameters()))
                for _ in range(3):
                    opt.zero_grad()
                    model(x).pow(2).sum().backward()
                    opt.step()
                states[i] = {k: v.clone() for k, v in model.state_dict().items()}
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return states, errors


@pytest.mark.parametrize("mode", ["sync", "async", "diloco"])
def test_a_worker_with_another_frozen_backbone_is_refused_naming_it(shards, mode):
    addresses = [s.address for s in shards(2)]
    diloco = {"local_steps": 2} if mode == "diloco" else {}

    def connect(i: int) -> Any:
        # Worker 0 waits for the refused worker 1 until this deadline.
        return psworker.connect(
            addresses, worker_id=i, num_workers=2, mode=mode, timeout=8, **diloco
        )

    _, errors = run_two(connect, seeds=(1, 2))
    assert 1 in errors, errors  # worker 0's backbone is the job's
    message = str(errors[1])
    assert isinstance(errors[1], ModelMismatchError), message
    assert "parameters in no optimizer group" in message, message
    assert "this worker's are 0.weight, 0.bias" in message, message


def test_workers_holding_the_same_frozen_backbone_train(shards):
    addresses = [s.address for s in shards(2)]

    def connect(i: int) -> Any:
        return psworker.connect(addresses, worker_id=i, num_workers=2, mode="sync", timeout=20)

    states, errors = run_two(connect, seeds=(1, 1))
    assert not errors, errors
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not torch.equal(states[0]["2.weight"], build(1)[2].weight)  # the head trained


def test_allreduce_starts_every_rank_from_rank_0s_frozen_backbone():
    servers = [RingServer("127.0.0.1:0") for _ in range(2)]
    peers = [s.address for s in servers]

    def connect(i: int) -> Any:
        return psworker.connect(peers, worker_id=i, mode="allreduce", server=servers[i], timeout=20)

    states, errors = run_two(connect, seeds=(1, 2))
    assert not errors, errors
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
    assert torch.equal(states[1]["0.weight"], build(1)[0].weight)  # rank 0's, as DDP


@pytest.mark.parametrize("mode", ["local", "sync"])
def test_a_layer_unfrozen_mid_training_trains_as_in_torch_and_warns_of_nothing(shards, mode):
    """Gradual unfreezing: the whole model in the optimizer, the first layer frozen until
    step 3. Its first gradient is one a backward reached, not a stale one."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    states = []
    for distributed in (False, True):
        model = build(1)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        address = [shards(1)[0].address] if mode == "sync" else []
        client = psworker.connect(address, mode=mode) if distributed else None
        opt = DistributedOptimizer(model, client, inner) if client is not None else inner
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for t in range(6):
                if t == 3:
                    model[0].requires_grad_(True)
                opt.zero_grad()
                model(x).pow(2).sum().backward()
                opt.step()
        if client is not None:
            client.close()
        states.append(model.state_dict())
    assert not torch.equal(states[1]["0.weight"], build(1)[0].weight)  # it trained once unfrozen
    for name, want in states[0].items():
        assert torch.allclose(states[1][name], want, rtol=0, atol=1e-6), name
