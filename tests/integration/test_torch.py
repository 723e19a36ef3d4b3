"""DistributedOptimizer: sync with 2 workers equals local with the combined batch; buffers, None."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

STEPS, BATCH = 30, 8


def make_model(seed: int, batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU()]
    if batchnorm:
        layers.append(torch.nn.BatchNorm2d(4))
    layers += [torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 10)]
    return torch.nn.Sequential(*layers)


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(opt: DistributedOptimizer, x: torch.Tensor, y: torch.Tensor, steps: int, lo, hi) -> None:
    for t in range(steps):
        opt.zero_grad()
        a, b = lo(t), hi(t)
        torch.nn.functional.cross_entropy(opt.model(x[a:b]), y[a:b]).backward()
        opt.step()


@pytest.mark.parametrize(
    "optimizer", [psworker.SGD(lr=0.1, momentum=0.9), psworker.Adam(lr=0.01)], ids=["sgd", "adam"]
)
def test_sync_two_workers_equal_local_with_the_combined_batch(shards, optimizer):
    x, y = data(STEPS * 2 * BATCH)
    local_model = make_model(0)
    with psworker.connect(mode="local") as local:
        opt = DistributedOptimizer(local_model, local, optimizer)
        train(opt, x, y, STEPS, lambda t: 2 * BATCH * t, lambda t: 2 * BATCH * (t + 1))

    addrs = [s.address for s in shards(2)]
    models = {0: make_model(0), 1: make_model(123)}  # worker 1 starts elsewhere: init must fix it

    def worker(i: int):
        def run():
            with psworker.connect(
                addrs, worker_id=i, num_workers=2, mode="sync", split_bytes=512
            ) as client:
                opt = DistributedOptimizer(models[i], client, optimizer)
                lo = lambda t: 2 * BATCH * t + i * BATCH  # noqa: E731
                train(opt, x, y, STEPS, lo, lambda t: lo(t) + BATCH)

        return run

    run_workers([worker(0), worker(1)])
    reference = local_model.state_dict()
    for i, model in models.items():
        for name, value in model.state_dict().items():
            diff = (value - reference[name]).abs().max().item()
            assert diff < 1e-5, f"worker {i} {name}: max abs diff {diff}"


def test_local_mode_matches_torch_optim():
    x, y = data(20 * BATCH)
    ours, theirs = make_model(0), make_model(0)
    with psworker.connect(mode="local") as client:
        opt = DistributedOptimizer(ours, client, psworker.SGD(lr=0.05, momentum=0.9, nesterov=True))
        train(opt, x, y, 20, lambda t: BATCH * t, lambda t: BATCH * (t + 1))
    ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    for t in range(20):
        ref.zero_grad()
        a = BATCH * t
        torch.nn.functional.cross_entropy(theirs(x[a : a + BATCH]), y[a : a + BATCH]).backward()
        ref.step()
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_local_mode_steps_the_model_in_place_keeping_what_the_script_wrote():
    """The client holds a CPU model's values in its own tensors: a weight the script changes
    between steps (a max-norm clamp, a reload) stays changed, as with torch.optim, and the
    client reads it back; nothing is copied back into the model after a step."""
    x, y = data(4 * BATCH)
    ours, theirs = make_model(0), make_model(0)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    with psworker.connect(mode="local") as client:
        opt = DistributedOptimizer(ours, client, psworker.SGD(lr=0.05, momentum=0.9))
        for t in range(4):
            for model, step in ((ours, opt), (theirs, ref)):
                step.zero_grad()
                batch = slice(BATCH * t, BATCH * (t + 1))
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                step.step()
                with torch.no_grad():
                    model[0].weight.clamp_(-0.1, 0.1)
        held = client.pull()
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    assert bool((ours[0].weight.abs() <= 0.1).all())
    assert np.array_equal(held["0.weight"], ours[0].weight.detach().numpy())


def test_allreduce_ranks_step_their_models_in_place_keeping_what_each_wrote():
    """allreduce, 2 ranks: each rank's model is its replica, stepped in place; the same clamp
    on every rank after every step stays, as with DDP, and the ranks end bit-identical and
    equal to plain torch training on both halves of each batch with the clamp."""
    from psworker.ring.ring import RingServer

    x, y = data(8 * BATCH)
    servers = [RingServer("127.0.0.1:0") for _ in range(2)]
    peers = [s.address for s in servers]
    models = {0: make_model(0), 1: make_model(123)}  # rank 0's weights start both

    def clamped(opt, model, batches) -> None:
        for batch in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            with torch.no_grad():
                model[0].weight.clamp_(-0.1, 0.1)

    def rank(i: int):
        def run():
            with psworker.connect(
                peers, worker_id=i, mode="allreduce", server=servers[i], timeout=20
            ) as client:
                opt = DistributedOptimizer(models[i], client, psworker.SGD(lr=0.05))
                halves = [
                    slice(2 * BATCH * t + i * BATCH, 2 * BATCH * t + (i + 1) * BATCH)
                    for t in range(4)
                ]
                clamped(opt, models[i], halves)

        return run

    run_workers([rank(0), rank(1)])
    reference = make_model(0)  # plain torch
    ref = torch.optim.SGD(reference.parameters(), lr=0.05)
    clamped(ref, reference, [slice(2 * BATCH * t, 2 * BATCH * (t + 1)) for t in range(4)])
    for (name, a), b in zip(
        models[0].state_dict().items(), models[1].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    for (name, a), b in zip(
        models[0].state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name
    assert bool((models[0][0].weight.abs() <= 0.1).all())


def test_batchnorm_buffers_are_averaged_across_sync_workers(shards):
    addrs = [s.address for s in shards(1)]
    x, y = data(4 * BATCH)
    models = {0: make_model(0, batchnorm=True), 1: make_model(0, batchnorm=True)}
    expected_mean = torch.zeros(4)
    with torch.no_grad():  # what each worker's first forward does to running_mean, averaged
        for i in range(2):
            feats = torch.relu(models[0][0](x[i * BATCH : (i + 1) * BATCH]))
            expected_mean += 0.5 * 0.1 * feats.mean(dim=(0, 2, 3))

    def worker(i: int):
        def run():
            with psworker.connect(addrs, worker_id=i, num_workers=2, mode="sync") as client:
                opt = DistributedOptimizer(models[i], client, psworker.SGD(lr=0.0))
                train(opt, x, y, 1, lambda t: i * BATCH, lambda t: (i + 1) * BATCH)

        return run

    run_workers([worker(0), worker(1)])
    bn0, bn1 = models[0][2], models[1][2]
    assert torch.equal(bn0.running_mean, bn1.running_mean)
    assert torch.equal(bn0.running_var, bn1.running_var)
    assert int(bn0.num_batches_tracked) == 1
    assert torch.allclose(bn0.running_mean, expected_mean, atol=1e-6)


class ReplacedStat(torch.nn.Module):
    """A running statistic updated by replacing its buffer (``self.stat = ...``, as some
    custom norm layers do, where BatchNorm writes in place), and a cache regrown for longer
    inputs (another shape: the model's own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("stat", torch.zeros(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.stat = 0.9 * self.stat + 0.1 * h.detach().mean(0)
        if self.cache.shape[0] < x.shape[0]:
            self.cache = torch.arange(float(x.shape[0]))
        return h * self.cache[: x.shape[0], None]


def stat_batches() -> dict[tuple[int, int], torch.Tensor]:
    """Each (step, worker)'s batch of 3 for ``ReplacedStat``."""
    return {
        (t, i): torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * t + i))
        for t in range(3)
        for i in range(2)
    }


@pytest.mark.parametrize("overlap", [False, True])
def test_a_buffer_replaced_in_forward_is_averaged_across_sync_workers(shards, overlap):
    """Was: the replacement never synced (the job kept the first tensor), the workers' stats
    drifted apart with no word."""
    addrs = [s.address for s in shards(1)]
    batches = stat_batches()
    models = {i: ReplacedStat() for i in range(2)}
    expected = torch.zeros(4)
    with torch.no_grad():  # the weights stay put (lr 0): each step's update, averaged
        for t in range(3):
            means = [models[0].lin(batches[t, i]).mean(0) for i in range(2)]
            expected = 0.9 * expected + 0.1 * (means[0] + means[1]) / 2

    def worker(i: int):
        def run():
            model = models[i]
            with psworker.connect(addrs, worker_id=i, num_workers=2, mode="sync") as client:
                inner = torch.optim.SGD(model.parameters(), lr=0.0)
                opt = DistributedOptimizer(model, client, inner, overlap=overlap)
                for t in range(3):
                    opt.zero_grad()
                    model(batches[t, i]).pow(2).mean().backward()
                    opt.step()
                opt.synchronize()

        return run

    run_workers([worker(0), worker(1)])
    assert torch.equal(models[0].stat, models[1].stat)
    assert torch.allclose(models[0].stat, expected, atol=1e-6)
    assert models[0].cache.shape == (3,)  # regrown, left to the model


def test_unused_parameters_with_none_gradients_are_left_alone():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
    before = model["unused"].weight.detach().clone()
    with psworker.connect(mode="local") as client:
        opt = DistributedOptimizer(model, client, psworker.SGD(lr=0.1))
        for _ in range(3):
            opt.zero_grad()
            model["used"](torch.ones(2, 3)).sum().backward()
            assert model["unused"].weight.grad is None
            opt.step()
        assert client.step == 3
    assert torch.equal(model["unused"].weight, before)
    assert not torch.equal(model["used"].bias, torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU path runs above")
def test_cuda_parameters_train_through_reused_pinned_buffers():
    x, y = data(10 * BATCH)
    cpu_model, gpu_model = make_model(0), make_model(0).cuda()
    with psworker.connect(mode="local") as c1, psworker.connect(mode="local") as c2:
        cpu_opt = DistributedOptimizer(cpu_model, c1, psworker.SGD(lr=0.1, momentum=0.9))
        gpu_opt = DistributedOptimizer(gpu_model, c2, psworker.SGD(lr=0.1, momentum=0.9))
        pointers = {n: t.data_ptr() for n, t in gpu_opt._staging.out.items()}
        assert all(t.is_pinned() for t in gpu_opt._staging.out.values())
        train(cpu_opt, x, y, 10, lambda t: BATCH * t, lambda t: BATCH * (t + 1))
        train(gpu_opt, x.cuda(), y.cuda(), 10, lambda t: BATCH * t, lambda t: BATCH * (t + 1))
        assert pointers == {n: t.data_ptr() for n, t in gpu_opt._staging.out.items()}
    for (name, a), b in zip(
        cpu_model.state_dict().items(), gpu_model.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b.cpu(), atol=1e-4), name


def allreduce_train(optimizer, compression=None) -> dict[int, torch.nn.Module]:
    from psworker.ring.ring import RingServer

    x, y = data(STEPS * 2 * BATCH)
    servers = [RingServer("127.0.0.1:0") for _ in range(2)]
    peers = [s.address for s in servers]
    models = {0: make_model(0), 1: make_model(99)}  # rank 0's weights must win

    def worker(i: int):
        def run():
            with psworker.connect(
                peers,
                worker_id=i,
                mode="allreduce",
                server=servers[i],
                timeout=20,
                compression=compression,
            ) as client:
                opt = DistributedOptimizer(models[i], client, optimizer)
                lo = lambda t: 2 * BATCH * t + i * BATCH  # noqa: E731
                train(opt, x, y, STEPS, lo, lambda t: lo(t) + BATCH)

        return run

    run_workers([worker(0), worker(1)])
    return models


def local_reference(optimizer) -> torch.nn.Module:
    x, y = data(STEPS * 2 * BATCH)
    model = make_model(0)
    with psworker.connect(mode="local") as local:
        opt = DistributedOptimizer(model, local, optimizer)
        train(opt, x, y, STEPS, lambda t: 2 * BATCH * t, lambda t: 2 * BATCH * (t + 1))
    return model


@pytest.mark.parametrize(
    "optimizer", [psworker.SGD(lr=0.1, momentum=0.9), psworker.Adam(lr=0.01)], ids=["sgd", "adam"]
)
def test_allreduce_two_workers_equal_local_with_the_combined_batch(optimizer):
    models = allreduce_train(optimizer)
    reference = local_reference(optimizer).state_dict()
    for i, model in models.items():
        for name, value in model.state_dict().items():
            diff = (value - reference[name]).abs().max().item()
            assert diff < 1e-5, f"rank {i} {name}: max abs diff {diff}"
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), "replicas diverged"


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_allreduce_with_16_bit_gradients_stays_close_to_full_precision(compression):
    optimizer = psworker.SGD(lr=0.1, momentum=0.9)
    models = allreduce_train(optimizer, compression)
    reference = local_reference(optimizer).state_dict()
    worst = max(
        (value - reference[name]).abs().max().item()
        for name, value in models[0].state_dict().items()
    )
    assert 0 < worst < 0.05, worst  # not bit-equal (16-bit wire) but close after 30 steps
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), "replicas diverged"


def test_a_buffer_replaced_in_forward_is_averaged_across_diloco_workers(shards):
    """DiLoCo's outer step takes each worker's buffers as they are and lands their mean. Was:
    the replacement never reached it (the job kept the first tensor), the workers' stats
    stayed their own."""
    addrs = [s.address for s in shards(1)]
    batches = stat_batches()
    models = {i: ReplacedStat() for i in range(2)}
    local = [torch.zeros(4), torch.zeros(4)]
    with torch.no_grad():  # the weights stay put (lr 0): each worker's own 3 updates
        for t in range(3):
            for i in range(2):
                local[i] = 0.9 * local[i] + 0.1 * models[0].lin(batches[t, i]).mean(0)
    expected = (local[0] + local[1]) / 2

    def worker(i: int):
        def run():
            model = models[i]
            with psworker.connect(
                addrs,
                worker_id=i,
                num_workers=2,
                mode="diloco",
                local_steps=3,
                outer=psworker.SGD(lr=0.7),
            ) as client:
                inner = torch.optim.SGD(model.parameters(), lr=0.0)
                opt = DistributedOptimizer(model, client, inner)
                for t in range(3):
                    opt.zero_grad()
                    model(batches[t, i]).pow(2).mean().backward()
                    opt.step()
                assert client.outer.step == 1

        return run

    run_workers([worker(0), worker(1)])
    assert torch.equal(models[0].stat, models[1].stat)
    assert torch.allclose(models[0].stat, expected, atol=1e-6)
    assert models[0].cache.shape == (3,)  # regrown, left to the model


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_step_with_a_closure_returns_its_loss_and_trains_as_torch(shards, mode):
    """``opt.step(closure)`` (torch's form: the closure zeroes, runs forward and backward,
    and returns the loss) runs the closure once, steps its gradients and returns its loss,
    with ``overlap=True`` too (which then keeps the serial step)."""
    x, y = data(4 * BATCH)

    def fit(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        losses = []
        for t in range(4):

            def closure(t: int = t) -> torch.Tensor:
                opt.zero_grad()
                batch = slice(t * BATCH, (t + 1) * BATCH)
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                loss.backward()
                return loss

            losses.append(opt.step(closure).item())
        return losses

    reference = make_model(0)
    expected = fit(reference, torch.optim.Adam(reference.parameters(), lr=0.01))
    for overlap in (False, True):
        model = make_model(0)
        if mode == "allreduce":
            from psworker.ring.ring import RingServer

            ring = RingServer("127.0.0.1:0")
            connect = psworker.connect([ring.address], mode=mode, server=ring, timeout=20)
        else:
            connect = psworker.connect([s.address for s in shards(1)], mode=mode)
        with connect as client, pytest.warns(UserWarning) if overlap else nullcontext():
            inner = torch.optim.Adam(model.parameters(), lr=0.01)
            losses = fit(model, DistributedOptimizer(model, client, inner, overlap=overlap))
        assert losses == pytest.approx(expected, abs=1e-5)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6)
