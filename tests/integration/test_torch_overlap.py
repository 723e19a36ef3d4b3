"""DistributedOptimizer(overlap=True): pushes from backward's hooks and weights landing before
each module's forward give the serial step's results bit for bit; scripts that change
gradients before step() keep the serial step, or get an error, never a different step."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from pswire.errors import ConfigError  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

STEPS, BATCH = 6, 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),  # buffers travel with the shard's push
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    convs = [p for n, p in model.named_parameters() if n.startswith(("0.", "1."))]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("0.", "1."))]
    return torch.optim.SGD([{"params": convs, "lr": 0.05}, {"params": rest}], lr=0.1, momentum=0.9)


def train(
    addrs: list[str],
    mode: str,
    workers: int,
    overlap: bool,
    clip_at: frozenset[int] = frozenset(),
    accumulate: bool = False,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, DistributedOptimizer]]:
    """Each worker's final state_dict (and optimizer) after STEPS steps on its own slice."""
    x, y = data(STEPS * workers * BATCH * 2)
    states: dict[int, dict[str, torch.Tensor]] = {}
    opts: dict[int, DistributedOptimizer] = {}
    # Built here: torch's global RNG is not for threads. Worker 1 starts elsewhere: init fixes it.
    models = {i: make_model(i) for i in range(workers)}

    def worker(i: int):
        def run():
            model = models[i]
            with psworker.connect(
                addrs, worker_id=i, num_workers=workers, mode=mode, split_bytes=1024
            ) as client:
                inner = two_groups(model)
                opt = DistributedOptimizer(model, client, inner, overlap=overlap)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                opts[i] = opt
                for t in range(STEPS):
                    a = (t * workers + i) * BATCH
                    opt.zero_grad()
                    loss_fn = torch.nn.functional.cross_entropy
                    loss_fn(model(x[a : a + BATCH]), y[a : a + BATCH]).backward()
                    if accumulate:
                        b = a + STEPS * workers * BATCH
                        loss_fn(model(x[b : b + BATCH]), y[b : b + BATCH]).backward()
                    if t in clip_at:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                    opt.step()
                    sched.step()
                states[i] = {k: v.clone() for k, v in model.state_dict().items()}

        return run

    run_workers([worker(i) for i in range(workers)])
    return states, opts


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max diff {(a[name] - b[name]).abs().max()}"


def test_sync_with_overlap_is_bit_identical_to_the_serial_step(shards):
    serial, _ = train([s.address for s in shards(2)], "sync", 2, overlap=False)
    overlapped, opts = train([s.address for s in shards(2)], "sync", 2, overlap=True)
    assert all(opt._overlap is not None and opt._overlap.armed for opt in opts.values())
    for i in range(2):
        assert_identical(serial[i], overlapped[i])
    assert_identical(overlapped[0], overlapped[1])


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_one_worker_async_and_ssp_with_overlap_match_the_serial_step(shards, mode):
    # With one worker the order of applies is fixed: overlap must not change a bit.
    serial, _ = train([s.address for s in shards(2)], mode, 1, overlap=False)
    overlapped, opts = train([s.address for s in shards(2)], mode, 1, overlap=True)
    assert opts[0]._overlap is not None and opts[0]._overlap.armed
    assert_identical(serial[0], overlapped[0])


def test_async_two_workers_with_overlap_train_every_weight(shards):
    start = make_model(0).state_dict()
    states, opts = train([s.address for s in shards(2)], "async", 2, overlap=True)
    for i, state in states.items():
        assert opts[i].client.step == STEPS
        for name, value in state.items():
            assert torch.isfinite(value.float()).all(), name
            if name.endswith("weight"):
                assert not torch.equal(value, start[name]), f"worker {i}: {name} never moved"


def test_clipping_keeps_the_serial_step_with_a_warning(shards):
    every = frozenset(range(STEPS))
    serial, _ = train([s.address for s in shards(1)], "sync", 1, overlap=False, clip_at=every)
    with pytest.warns(UserWarning, match="keeps the serial step.*clip_grad_norm_"):
        overlapped, opts = train(
            [s.address for s in shards(1)], "sync", 1, overlap=True, clip_at=every
        )
    assert opts[0]._overlap is not None and not opts[0]._overlap.armed
    assert_identical(serial[0], overlapped[0])


def test_accumulating_backwards_keeps_the_serial_step(shards):
    serial, _ = train([s.address for s in shards(1)], "sync", 1, overlap=False, accumulate=True)
    with pytest.warns(UserWarning, match="accumulated by several backward"):
        overlapped, _ = train(
            [s.address for s in shards(1)], "sync", 1, overlap=True, accumulate=True
        )
    assert_identical(serial[0], overlapped[0])


def test_a_clip_after_overlap_armed_is_an_error(shards):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: overlap armed on step 0
        with pytest.raises(ConfigError, match=r"overlap=True the gradients of \[.*changed"):
            train([s.address for s in shards(1)], "sync", 1, overlap=True, clip_at=frozenset({3}))


def test_overlap_is_refused_where_there_is_no_per_shard_step():
    with psworker.connect(mode="local") as client:
        model = make_model(0)
        with pytest.raises(ConfigError, match="overlap=True is not supported here: mode 'local'"):
            DistributedOptimizer(model, client, two_groups(model), overlap=True)
