"""DistributedOptimizer(overlap=True): pushes from backward's hooks and weights landing before
each module's forward give the serial step's results bit for bit; scripts that change
gradients before step() keep the serial step, or get an error, never a different step."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from states import assert_identical  # noqa: E402
from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from pswire.errors import ConfigError, PSError, WaitTimeoutError  # noqa: E402
from psworker.client import PSClient  # noqa: E402
from psworker.ring.client import AllReduceClient  # noqa: E402
from psworker.ring.ring import RingServer  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

STEPS, BATCH = 6, 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),  # buffers travel with the shard's push
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 2, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


# Fine-tuning: step -> the layers (name prefixes) frozen from that step on (0: before
# DistributedOptimizer is made). The conv is unfrozen on step 2, an overlapped step (overlap
# arms after step 0): its gradients are new to the hooks then.
FREEZES = {0: ("0.",), 2: (), 4: ("4.",)}


def set_frozen(model: torch.nn.Module, prefixes: tuple[str, ...], under: str = "") -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(tuple(under + p for p in prefixes)))


def two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    convs = [p for n, p in model.named_parameters() if n.startswith(("0.", "1."))]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("0.", "1."))]
    return torch.optim.SGD([{"params": convs, "lr": 0.05}, {"params": rest}], lr=0.1, momentum=0.9)


def train(
    addrs: list[str],
    mode: str,
    workers: int,
    overlap: bool | str,
    clip_at: frozenset[int] = frozenset(),
    accumulate: bool = False,
    steps: int = STEPS,
    overlapped_s: dict[int, float] | None = None,
    freezes: dict[int, tuple[str, ...]] | None = None,
    grpc_below_bytes: int | None = None,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, DistributedOptimizer]]:
    """Each worker's final state_dict (and optimizer) after ``steps`` steps on its own slice.
    ``overlapped_s``: overlap="auto"'s clock, per worker: a serial step takes 1 s, an
    overlapped one this long; ``freezes``: as ``FREEZES``; ``memory_format``: the model's
    (``model.to(memory_format=...)``)."""
    freezes = freezes or {}
    options = {} if grpc_below_bytes is None else {"grpc_below_bytes": grpc_below_bytes}
    x, y = data(steps * workers * BATCH * 2)
    states: dict[int, dict[str, torch.Tensor]] = {}
    opts: dict[int, DistributedOptimizer] = {}
    # Built here: torch's global RNG is not for threads. Worker 1 starts elsewhere: init fixes it.
    models = {i: make_model(i).to(memory_format=memory_format) for i in range(workers)}

    def worker(i: int):
        def run():
            model = models[i]
            with psworker.connect(
                addrs, worker_id=i, num_workers=workers, mode=mode, split_bytes=1024, **options
            ) as client:
                inner = two_groups(model)
                set_frozen(model, freezes.get(0, ()))
                opt = DistributedOptimizer(model, client, inner, overlap=overlap)
                if overlapped_s is not None:
                    assert opt._trial is not None
                    opt._trial._clock = fake_clock(opt, overlapped_s[i])
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                opts[i] = opt
                for t in range(steps):
                    if t and t in freezes:
                        set_frozen(model, freezes[t])
                    a = (t * workers + i) * BATCH
                    opt.zero_grad()
                    loss_fn = torch.nn.functional.cross_entropy
                    loss_fn(model(x[a : a + BATCH]), y[a : a + BATCH]).backward()
                    if accumulate:
                        b = a + steps * workers * BATCH
                        loss_fn(model(x[b : b + BATCH]), y[b : b + BATCH]).backward()
                    if t in clip_at:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                    opt.step()
                    sched.step()
                states[i] = {k: v.clone() for k, v in model.state_dict().items()}

        return run

    run_workers([worker(i) for i in range(workers)])
    return states, opts


def assert_every_weight_trained(
    states: dict[int, dict[str, torch.Tensor]],
    opts: dict[int, DistributedOptimizer],
    start: dict[str, torch.Tensor],
    steps: int,
) -> None:
    """Every worker took ``steps`` steps, and each weight is finite and moved from ``start``."""
    for i, state in states.items():
        assert opts[i].client.step == steps
        for name, value in state.items():
            assert torch.isfinite(value.float()).all(), name
            if name.endswith("weight"):
                assert not torch.equal(value, start[name]), f"worker {i}: {name} never moved"


def fake_clock(opt: DistributedOptimizer, overlapped_s: float):
    """A clock that moves 1 s per serial step and ``overlapped_s`` per overlapped one (read
    once per step, at its end)."""
    now = [0.0]

    def clock() -> float:
        now[0] += overlapped_s if opt.overlapping else 1.0
        return now[0]

    return clock


def test_sync_with_overlap_is_bit_identical_to_the_serial_step(shards):
    serial, _ = train([s.address for s in shards(2)], "sync", 2, overlap=False)
    overlapped, opts = train([s.address for s in shards(2)], "sync", 2, overlap=True)
    assert all(opt._overlap is not None and opt._overlap.armed for opt in opts.values())
    for i in range(2):
        assert_identical(serial[i], overlapped[i])
    assert_identical(overlapped[0], overlapped[1])


@pytest.mark.parametrize("grpc_below_bytes", [0, 1 << 30], ids=["streamed", "whole"])
def test_closing_right_after_the_last_step_lands_it_on_the_shards(shards, grpc_below_bytes):
    """``step()`` returns before its reply with overlap; the client's ``close()`` (here the
    ``with`` block's end, nothing read from the model after it) must not cut that step off.
    The layers are large enough (2 MiB) that the last push is still on its way at close."""
    x = torch.randn(BATCH, 512, generator=torch.Generator().manual_seed(1))

    def shard_values(overlap: bool) -> dict[str, torch.Tensor]:
        servers = shards(2)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512)
        )
        addresses = [s.address for s in servers]
        with psworker.connect(addresses, mode="sync", grpc_below_bytes=grpc_below_bytes) as c:
            opt = DistributedOptimizer(model, c, two_groups(model), overlap=overlap)
            for _ in range(STEPS):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            assert overlap is (opt._overlap is not None and opt._overlap.armed)
        values = {}
        for server in servers:
            values.update({k: torch.from_numpy(v) for k, v in server.shard.snapshot().items()})
        return values

    assert_identical(shard_values(overlap=False), shard_values(overlap=True))


class RootParam(torch.nn.Module):
    """A parameter of the root module itself (a ViT's position embedding): a deep copy takes
    it before it reaches the root's hooks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = torch.nn.Parameter(torch.ones(512))
        self.body = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh())
        self.head = torch.nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x * self.scale))


@pytest.mark.parametrize("how", ["deepcopy", "averaged-model", "torch-save"])
def test_a_copy_of_the_model_right_after_step_holds_the_landed_weights(shards, tmp_path, how):
    """An EMA's ``AveragedModel``, a target network's ``deepcopy``, ``torch.save(model)``:
    made while the step's weights still land, the copy waits for them, and carries no hook."""
    x = torch.randn(BATCH, 512, generator=torch.Generator().manual_seed(1))
    model = RootParam()
    addresses = [s.address for s in shards(2)]
    with psworker.connect(addresses, mode="sync", grpc_below_bytes=0) as client:
        opt = DistributedOptimizer(model, client, two_groups(model), overlap=True)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        assert opt._overlap is not None and opt._overlap.armed
        if how == "deepcopy":
            copied = copy.deepcopy(model)
        elif how == "averaged-model":
            copied = torch.optim.swa_utils.AveragedModel(model).module
        else:
            torch.save(model, tmp_path / "model.pt")
            copied = torch.load(tmp_path / "model.pt", weights_only=False)
        opt.synchronize()
        assert_identical(copied.state_dict(), model.state_dict())
        assert not torch.equal(copied.scale, torch.ones(512))  # it trained
        copied(x).sum().backward()  # the copy is a model of its own: nothing of the job's
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()  # the job goes on
        opt.synchronize()
        assert not torch.equal(copied.head.weight, model.head.weight)


def test_a_step_that_failed_landing_raises_at_close_but_never_hides_the_blocks_error(shards):
    def failed() -> None:
        raise WaitTimeoutError("shard 0's reply to step 3 did not land")

    address = shards(1)[0].address
    client = psworker.connect([address], mode="sync")
    client.before_close(failed)
    with pytest.raises(WaitTimeoutError, match="did not land"):
        client.close()
    assert client.closed  # closed all the same
    own = pytest.raises(KeyError, match="the script's own")  # not the landing's error
    with own, psworker.connect([address], mode="sync") as client:
        client.before_close(failed)
        raise KeyError("the script's own")
    assert client.closed
    waited = []  # Ctrl-C leaves at once: nothing in flight is waited for
    with pytest.raises(KeyboardInterrupt), psworker.connect([address], mode="sync") as client:
        client.before_close(lambda: waited.append(1))
        raise KeyboardInterrupt
    assert client.closed and not waited


@pytest.mark.parametrize("overlapped_s", [0.5, 1.5])
def test_sync_with_overlap_auto_keeps_the_faster_and_every_bit(shards, overlapped_s):
    # overlap="auto": 6 serial steps timed, then 4 overlapped; the faster kept, the same bits.
    steps = 13
    serial, _ = train([s.address for s in shards(2)], "sync", 2, overlap=False, steps=steps)
    auto, opts = train(
        [s.address for s in shards(2)],
        "sync",
        2,
        overlap="auto",
        steps=steps,
        overlapped_s={0: overlapped_s, 1: overlapped_s},
    )
    for i in range(2):
        trial = opts[i]._trial
        assert trial is not None and trial.chosen is (overlapped_s < 1.0)
        assert opts[i].overlapping is trial.chosen
        assert opts[i].client.step == steps
        assert_identical(serial[i], auto[i])


def test_async_workers_choosing_differently_both_finish(shards):
    # Worker 0 finds overlap slower and goes serial; worker 1 keeps it: its streamed pushes
    # beside worker 0's whole ones train every weight, every step counted.
    start = make_model(0).state_dict()
    steps = 14
    states, opts = train(
        [s.address for s in shards(2)],
        "async",
        2,
        overlap="auto",
        steps=steps,
        overlapped_s={0: 2.0, 1: 0.5},
    )
    assert [opts[i].overlapping for i in range(2)] == [False, True]
    assert_every_weight_trained(states, opts, start, steps)


def test_overlap_auto_is_the_serial_step_where_overlap_is_not_supported(caplog):
    # overlap=True raises in mode local (the test below); "auto" chooses the serial step.
    with psworker.connect(mode="local") as client, caplog.at_level("INFO", "psworker.torch"):
        model = make_model(0)
        opt = DistributedOptimizer(model, client, two_groups(model), overlap="auto")
        x, y = data(BATCH)
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        assert not opt.overlapping and opt.client.step == 2
    assert "overlap='auto' keeps the serial step" in caplog.text and "mode 'local'" in caplog.text


def test_overlap_must_be_a_bool_or_auto():
    with psworker.connect(mode="local") as client:
        model = make_model(0)
        with pytest.raises(ConfigError, match="overlap must be False, True or 'auto', got 'on'"):
            DistributedOptimizer(model, client, two_groups(model), overlap="on")


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
    assert_every_weight_trained(states, opts, start, STEPS)


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


def both_ways(shards: Any, **options: Any) -> tuple[dict, dict, dict[int, DistributedOptimizer]]:
    """``train`` in sync with 2 workers on 2 shards, serial and then overlapped (checked
    armed): each worker's states both ways, and the overlapped run's optimizers."""
    serial, _ = train([s.address for s in shards(2)], "sync", 2, overlap=False, **options)
    overlapped, opts = train([s.address for s in shards(2)], "sync", 2, overlap=True, **options)
    assert all(opt._overlap is not None and opt._overlap.armed for opt in opts.values())
    return serial, overlapped, opts


@pytest.mark.parametrize("grpc_below_bytes", [0, 1 << 30], ids=["streamed", "whole"])
def test_layers_frozen_and_unfrozen_between_steps_train_as_the_serial_step(
    shards, grpc_below_bytes
):
    """Fine-tuning's unfreeze: a layer frozen when DistributedOptimizer was made is waited for
    from the step it is unfrozen (was: its shard's push left without it, a silently
    different model); a layer frozen later is not waited for."""
    serial, overlapped, _ = both_ways(shards, grpc_below_bytes=grpc_below_bytes, freezes=FREEZES)
    start = make_model(0).state_dict()
    assert not torch.equal(serial[0]["0.weight"], start["0.weight"])  # unfrozen, trained
    for i in range(2):
        assert_identical(serial[i], overlapped[i])


@pytest.mark.parametrize("grpc_below_bytes", [0, 1 << 30], ids=["streamed", "whole"])
def test_a_channels_last_model_trains_as_the_serial_step(shards, grpc_below_bytes):
    """A conv's weight in channels_last is no C-contiguous array: its reply cannot be decoded
    straight into it (was: decoded elsewhere and never copied in, a silently stale conv)."""
    serial, overlapped, opts = both_ways(
        shards, grpc_below_bytes=grpc_below_bytes, memory_format=torch.channels_last
    )
    assert not opts[0].model[0].weight.is_contiguous()  # still channels_last
    for i in range(2):
        assert_identical(serial[i], overlapped[i])


def slow_replies(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.05) -> None:
    """Every shard's whole reply lands ``delay_s`` late: a read right after ``step()`` comes
    before it."""
    real = PSClient.start_shard_step

    def slow(self: PSClient, *args: Any, **kwargs: Any) -> Any:
        done = real(self, *args, **kwargs)

        def later() -> bool:
            time.sleep(delay_s)
            return done()

        return later

    monkeypatch.setattr(PSClient, "start_shard_step", slow)


def fit(
    opt: torch.optim.Optimizer,
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    after: Callable[[], None] = lambda: None,
) -> None:
    """STEPS steps of cross-entropy on consecutive batches of ``x`` and ``y`` through
    ``forward`` (the model, or a compiled one); ``after()`` right after each ``step()``."""
    for t in range(STEPS):
        opt.zero_grad()
        part = slice(t * BATCH, (t + 1) * BATCH)
        torch.nn.functional.cross_entropy(forward(x[part]), y[part]).backward()
        opt.step()
        after()


def ema_run(addrs: list[str] | None, overlap: bool) -> list[torch.Tensor]:
    """An EMA (``AveragedModel``) updated, a weight's norm logged and the weights read
    straight from the parameters, each right after ``step()``, as scripts do."""
    swa = torch.optim.swa_utils
    model = make_model(0)
    x, y = data(STEPS * BATCH)
    seen = []
    with contextlib.ExitStack() as stack:
        inner: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if addrs is not None:
            client = stack.enter_context(psworker.connect(addrs, mode="sync", split_bytes=1024))
            inner = DistributedOptimizer(model, client, inner, overlap=overlap)
        ema = swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))

        def read() -> None:
            ema.update_parameters(model)
            seen.append(model[4].weight.norm().detach())

        fit(inner, model, x, y, after=read)
        seen += [p.detach().clone() for p in model.parameters()]
        seen += [p.detach().clone() for p in ema.module.parameters()]
    assert torch._C._len_torch_function_stack() == 0  # nothing of ours left on the stack
    return seen


def test_reads_right_after_step_wait_for_the_landing_weights(shards, monkeypatch):
    """Between ``step()`` and the next forward the weights are still landing: an EMA's
    ``update_parameters``, a logged norm and a direct read wait for them (were: read the
    last step's weights, an EMA silently one step behind)."""
    slow_replies(monkeypatch)
    plain = ema_run(None, overlap=False)
    for overlap in (False, True):
        got = ema_run([s.address for s in shards(2)], overlap=overlap)
        for a, b in zip(plain, got, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_step_and_zero_grad_leave_the_weights_landing_under_the_next_forward(shards, monkeypatch):
    """What reads no weight's elements (``step()``'s and ``zero_grad()``'s ``.grad``, a
    shape, a hook) does not wait for the landing: the pull still overlaps the next forward."""
    slow_replies(monkeypatch, delay_s=0.5)
    model = make_model(0)
    x, y = data(BATCH)
    with psworker.connect([s.address for s in shards(2)], mode="sync", split_bytes=1024) as c:
        opt = DistributedOptimizer(model, c, two_groups(model), overlap=True)
        assert opt._overlap is not None
        landing = opt._overlap._landing  # type: ignore[attr-defined]
        for t in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()  # step 0 is serial: overlap arms after it
            opt.zero_grad()
            weight = model[4].weight
            assert weight.grad is None and weight.shape == (32, 256) and weight.requires_grad
            assert landing.pending is (t > 0)  # nothing above waited for the landing
        opt.synchronize()
        assert not landing.pending


def test_a_compiled_model_waits_for_the_landing_weights(shards, monkeypatch):
    """``torch.compile(model)`` after wrapping: the landing hooks run as they are, not as a
    trace made when nothing was landing (was: forwards on weights still landing, 0.03 from
    the serial step)."""
    slow_replies(monkeypatch)
    x, y = data(STEPS * BATCH)

    def run(overlap: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(128, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)
        )
        with psworker.connect([s.address for s in shards(2)], mode="sync", split_bytes=1024) as c:
            opt = DistributedOptimizer(model, c, two_groups(model), overlap=overlap)
            fit(opt, torch.compile(model), x, y)
            assert overlap is (opt._overlap is not None and opt._overlap.armed)
            return {k: v.clone() for k, v in model.state_dict().items()}

    # Close, not identical: the hooks split the compiled graph, and inductor fuses the parts
    # otherwise (1e-8 apart).
    serial, overlapped = run(overlap=False), run(overlap=True)
    for name, value in serial.items():
        torch.testing.assert_close(overlapped[name], value, rtol=1e-5, atol=1e-6)


def test_a_model_moved_to_channels_last_after_wrapping_trains_as_the_serial_step(shards):
    """``model.to(memory_format=...)`` after ``DistributedOptimizer`` gives each conv weight
    new memory: replies are decoded where the weights are now (was: into the old memory, the
    convs never updated, 0.09 from torch)."""
    x, y = data(STEPS * BATCH)

    def run(overlap: bool) -> dict[str, torch.Tensor]:
        model = make_model(0)
        with psworker.connect([shards(1)[0].address], mode="sync") as client:
            opt = DistributedOptimizer(model, client, two_groups(model), overlap=overlap)
            model.to(memory_format=torch.channels_last)
            assert not model[0].weight.is_contiguous()
            fit(opt, model, x, y)
            assert overlap is (opt._overlap is not None and opt._overlap.armed)
            return {k: v.clone() for k, v in model.state_dict().items()}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the serial step's "changed in place": new memory
        assert_identical(run(overlap=False), run(overlap=True))


def test_a_gradient_set_by_hand_after_its_shards_push_left_is_an_error(shards):
    """A frozen layer's gradient set after backward, once its shard's push left without it:
    an error at step(), not a step without it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)
    with psworker.connect([shards(1)[0].address], mode="sync") as client:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = DistributedOptimizer(model, client, inner, overlap=True)
        with pytest.raises(ConfigError, match=r"gradients of \['0.weight'\] appeared after"):
            for t in range(3):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                if t == 2:  # overlap armed on step 0
                    model[0].weight.grad = torch.ones(4, 4)
                opt.step()
        assert opt._overlap is not None and opt._overlap.armed


def test_a_step_dropped_after_its_backward_is_an_error_at_zero_grad(shards):
    """The loss guard that checks after ``backward()`` and skips ``step()`` (``zero_grad()``,
    ``continue``): the serial step drops that step; with overlap its gradients already left,
    so ``zero_grad()`` says so (was: an error at the next step blaming clipping)."""
    x, y = data(4 * BATCH)

    def run(overlap: bool) -> int:
        model = make_model(0)
        with psworker.connect([shards(1)[0].address], mode="sync") as client:
            opt = DistributedOptimizer(model, client, two_groups(model), overlap=overlap)
            for t in range(4):
                opt.zero_grad()
                part = slice(t * BATCH, (t + 1) * BATCH)
                torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
                if t == 2:  # a bad batch, found after backward()
                    opt.zero_grad()
                    continue
                opt.step()
            return client.step

    assert run(overlap=False) == 3
    with pytest.raises(ConfigError, match=r"zero_grad\(\) after backward\(\) and before step"):
        run(overlap=True)


def test_overlap_is_refused_where_there_is_no_per_shard_step():
    with psworker.connect(mode="local") as client:
        model = make_model(0)
        with pytest.raises(ConfigError, match="overlap=True is not supported here: mode 'local'"):
            DistributedOptimizer(model, client, two_groups(model), overlap=True)


# -- allreduce: buckets from backward's hooks, as DDP ------------------------------------------


class Branchy(torch.nn.Module):
    """make_model's net with an extra layer before the head, used only on even steps (its
    gradient is None on odd ones: its bucket completes at step(), and the buckets after it in
    the plan with it; the head's two buckets before it still leave from backward)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_model(seed)
        self.extra = torch.nn.Linear(10, 10)
        self.head = torch.nn.Linear(10, 600)  # each of its tensors a bucket of its own
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return self.head(self.extra(h) if self.use_extra else h)


def ring_train(
    workers: int,
    overlap: bool | str,
    clip_at: frozenset[int] = frozenset(),
    stop: dict[int, int] | None = None,
    timeout: float = 20,
    failed: threading.Event | None = None,
    steps: int = STEPS,
    overlapped_s: dict[int, float] | None = None,
    freezes: dict[int, tuple[str, ...]] | None = None,
    skip: dict[int, int] | None = None,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, Any], dict[int, BaseException]]:
    """Each rank's final state_dict, its optimizer, and its error, after ``steps`` allreduce
    steps (``stop``: rank -> the step before which it closes its client, as a rank that died;
    ``failed`` is set when a rank fails; ``overlapped_s`` and ``freezes`` (of ``net``) as
    ``train``'s; ``skip``: rank -> the step it drops after backward, zeroing the gradients)."""
    freezes = freezes or {}
    servers = [RingServer("127.0.0.1:0") for _ in range(workers)]
    peers = [s.address for s in servers]
    x, y = data(steps * workers * BATCH)
    models = {i: Branchy(i) for i in range(workers)}
    states: dict[int, dict[str, torch.Tensor]] = {}
    opts: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(i: int) -> None:
        model = models[i]
        try:
            with psworker.connect(
                peers,
                worker_id=i,
                mode="allreduce",
                server=servers[i],
                timeout=timeout,
                bucket_bytes=2048,
            ) as client:
                convs = [p for n, p in model.named_parameters() if n.startswith(("net.0", "net.1"))]
                rest = [p for p in model.parameters() if all(p is not c for c in convs)]
                groups = [{"params": convs, "lr": 0.05}, {"params": rest}]
                inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
                set_frozen(model, freezes.get(0, ()), under="net.")
                opt = DistributedOptimizer(model, client, inner, overlap=overlap)
                if overlapped_s is not None:
                    opt._trial._clock = fake_clock(opt, overlapped_s[i])
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                opts[i] = opt
                for t in range(steps):
                    if stop is not None and stop.get(i) == t:
                        return
                    if t and t in freezes:
                        set_frozen(model, freezes[t], under="net.")
                    a = (t * workers + i) * BATCH
                    model.use_extra = t % 2 == 0
                    opt.zero_grad()
                    loss = torch.nn.functional.cross_entropy(
                        model(x[a : a + BATCH]), y[a : a + BATCH]
                    )
                    loss.backward()
                    if skip is not None and skip.get(i) == t:
                        opt.zero_grad()
                        continue
                    if t in clip_at:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                    opt.step()
                    sched.step()
                states[i] = {k: v.clone() for k, v in model.state_dict().items()}
        except BaseException as exc:
            errors[i] = exc
            if failed is not None:
                failed.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return states, opts, errors


@pytest.mark.parametrize("workers", [2, 3])
def test_allreduce_with_overlap_is_bit_identical_to_the_serial_step(workers, monkeypatch):
    started: list[int] = []
    real = AllReduceClient.start_bucket

    def counting(self: AllReduceClient, index: int, grads: Any) -> None:
        started.append(index)
        real(self, index, grads)

    monkeypatch.setattr(AllReduceClient, "start_bucket", counting)
    serial, _, errors = ring_train(workers, overlap=False)
    assert not errors and not started
    overlapped, opts, errors = ring_train(workers, overlap=True)
    assert not errors, errors
    assert all(opt._overlap is not None and opt._overlap.armed for opt in opts.values())
    buckets = opts[0].client.gradient_buckets()
    assert len(buckets) >= 3
    # Every bucket left from backward on even steps; on odd ones only those before extra's.
    assert buckets[:2] == [["head.bias"], ["head.weight"]] and "extra.bias" in buckets[2]
    assert started.count(len(buckets) - 1) == workers * (STEPS // 2 - 1)  # not on step 0
    assert started.count(1) == workers * (STEPS - 1)
    for i in range(workers):
        assert_identical(serial[i], overlapped[i])
    assert_identical(overlapped[0], overlapped[workers - 1])


def test_allreduce_layers_frozen_and_unfrozen_between_steps_train_as_the_serial_step():
    """As in the parameter-server modes (was: a ConfigError at the unfreeze, the layer's
    bucket having left without it)."""
    serial, _, errors = ring_train(2, overlap=False, freezes=FREEZES)
    assert not errors, errors
    overlapped, opts, errors = ring_train(2, overlap=True, freezes=FREEZES)
    assert not errors, errors
    assert all(opt._overlap.armed for opt in opts.values())
    for i in range(2):
        assert_identical(serial[i], overlapped[i])


@pytest.mark.parametrize(
    ("overlapped_s", "kept"),
    [
        ({0: 0.5, 1: 0.6}, True),
        # Rank 0 alone would keep overlap, rank 1 would not: their summed times decide for
        # both (2 s serial, 2.1 s overlapped), so the ranks run the same collectives.
        ({0: 0.5, 1: 1.6}, False),
    ],
)
def test_allreduce_overlap_auto_ranks_choose_together_and_keep_every_bit(overlapped_s, kept):
    steps = 14
    serial, _, errors = ring_train(2, overlap=False, steps=steps)
    assert not errors, errors
    auto, opts, errors = ring_train(2, overlap="auto", steps=steps, overlapped_s=overlapped_s)
    assert not errors, errors
    for i in range(2):
        assert opts[i]._trial.chosen is kept and opts[i].overlapping is kept
        assert opts[i].client.step == steps
        assert_identical(serial[i], auto[i])


def test_allreduce_clipping_keeps_the_serial_step_with_a_warning():
    every = frozenset(range(STEPS))
    serial, _, errors = ring_train(2, overlap=False, clip_at=every)
    assert not errors
    with pytest.warns(UserWarning, match="keeps the serial step.*clip_grad_norm_"):
        overlapped, opts, errors = ring_train(2, overlap=True, clip_at=every)
    assert not errors
    assert not opts[0]._overlap.armed
    assert_identical(serial[0], overlapped[0])


def test_allreduce_clip_after_overlap_armed_fails_every_rank_with_the_reason():
    _, _, errors = ring_train(2, overlap=True, clip_at=frozenset({2}), timeout=60)
    for i in (0, 1):
        assert isinstance(errors[i], PSError), errors
        # Each rank finds its own clip, or hears of the other's (not its 60 s timeout).
        assert "changed after backward() had sent them" in str(errors[i])


def test_allreduce_a_step_dropped_after_its_backward_fails_every_rank_with_the_reason():
    _, _, errors = ring_train(2, overlap=True, skip={0: 3}, timeout=60)
    assert isinstance(errors[0], ConfigError), errors
    for i in (0, 1):
        # Rank 1 hears of it through the ring (not its 60 s timeout).
        assert "zero_grad() after backward() and before step()" in str(errors[i]), errors


def test_allreduce_overlap_with_a_dead_rank_raises_instead_of_hanging():
    _, opts, errors = ring_train(2, overlap=True, stop={1: 3})
    assert set(errors) == {0} and opts[0]._overlap.armed
    assert isinstance(errors[0], PSError) and not isinstance(errors[0], WaitTimeoutError)
    assert "rank 1" in str(errors[0])


def test_allreduce_overlap_with_a_silent_rank_times_out_naming_it(monkeypatch):
    failed = threading.Event()
    real = DistributedOptimizer.step

    def stalls(self: DistributedOptimizer, *args: Any, **kwargs: Any) -> Any:
        # Rank 1 stops answering at step 3 (a paused process) until rank 0 gave up.
        if self.client.worker_id == 1 and self.client.step == 3:
            assert failed.wait(60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DistributedOptimizer, "step", stalls)
    _, opts, errors = ring_train(2, overlap=True, timeout=2, failed=failed)
    assert opts[0]._overlap.armed
    assert isinstance(errors[0], WaitTimeoutError) and "rank 1" in str(errors[0])
