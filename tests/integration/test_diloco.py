"""Local steps with an outer optimizer on the shards (DiLoCo): the same math as sync mode at H=1,
the paper's rule at H>1 (checked against torch in one process), asynchronous outer steps with
delayed Nesterov, fp16 pseudo-gradients, and H and the inner optimizer as part of the job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

torch = pytest.importorskip("torch")

from link_cluster import LIMITS, served  # noqa: E402
from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from pscore.optim import SGD  # noqa: E402
from psserver.shard import Shard  # noqa: E402
from pswire.errors import ConfigError, ModelMismatchError  # noqa: E402
from psworker.diloco import DiLoCoClient  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402
from psworker.torch_diloco import DiLoCoOptimizer  # noqa: E402

BATCH = 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def batch_of(worker: int, t: int, workers: int) -> slice:
    start = (t * workers + worker) * BATCH
    return slice(start, start + BATCH)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def train_workers(addrs, steps: int, make_inner, workers: int = 2, **connect) -> dict:
    """Each worker trains its own slice for ``steps`` inner steps; the models after."""
    x, y = data(steps * workers * BATCH)
    models = {i: make_model(0 if i == 0 else 100 + i) for i in range(workers)}

    def worker(i: int):
        def run():
            with psworker.connect(addrs, worker_id=i, num_workers=workers, **connect) as c:
                opt = DistributedOptimizer(models[i], c, make_inner(models[i]))
                for t in range(steps):
                    opt.zero_grad()
                    s = batch_of(i, t, workers)
                    loss_of(models[i], x[s], y[s]).backward()
                    opt.step()

        return run

    run_workers([worker(i) for i in range(workers)])
    return models


def assert_close(a: torch.nn.Module, b: torch.nn.Module, atol: float) -> None:
    for (name, u), v in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        diff = (u - v).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff}"


def test_one_local_step_with_outer_sgd_lr_1_is_sync_mode(shards):
    """H = 1, inner plain SGD, outer SGD lr 1.0 without momentum: the pseudo-gradient is lr
    times the gradient, so the outer step is sync mode's step (real shards, 2 of them)."""
    inner = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    steps = 12
    sync = train_workers([s.address for s in shards(2)], steps, inner, mode="sync", split_bytes=256)
    diloco = train_workers(
        [s.address for s in shards(2)],
        steps,
        inner,
        mode="diloco",
        local_steps=1,
        outer=SGD(lr=1.0),
        split_bytes=256,
    )
    assert_close(diloco[0], sync[0], 1e-6)
    assert_close(diloco[1], sync[0], 1e-6)
    moved = (sync[0][0].weight - make_model(0)[0].weight).abs().max().item()
    assert moved > 1e-3  # it trained


def reference_diloco(
    steps: int,
    h: int,
    workers: int,
    outer_lr: float,
    live: Callable[[int], Sequence[int]] | None = None,
) -> torch.nn.Module:
    """DiLoCo in one process with torch: per-worker Adam (state kept across outer steps),
    the mean pseudo-gradient stepped by torch.optim.SGD(nesterov) on the global model.
    ``live(t)``: the workers taking inner step t (default: all); a worker that arrives later
    starts from the global weights with a fresh Adam, and each outer step averages the
    workers present."""
    x, y = data(steps * workers * BATCH)
    global_model = make_model(0)
    outer = torch.optim.SGD(global_model.parameters(), lr=outer_lr, momentum=0.9, nesterov=True)
    local = [make_model(0) for _ in range(workers)]
    inner = [torch.optim.Adam(m.parameters(), lr=0.01) for m in local]
    started: set[int] = set()
    for t in range(steps):
        present = list(range(workers) if live is None else live(t))
        for i in present:
            if i not in started:
                local[i].load_state_dict(global_model.state_dict())
                started.add(i)
            inner[i].zero_grad()
            s = batch_of(i, t, workers)
            loss_of(local[i], x[s], y[s]).backward()
            inner[i].step()
        if (t + 1) % h == 0:
            with torch.no_grad():
                for g, *ls in zip(
                    global_model.parameters(),
                    *(local[i].parameters() for i in present),
                    strict=True,
                ):
                    g.grad = sum(g - p for p in ls) / len(present)
            outer.step()
            with torch.no_grad():
                for i in present:
                    for p, g in zip(local[i].parameters(), global_model.parameters(), strict=True):
                        p.copy_(g)
    return global_model


def test_sync_outer_steps_follow_the_paper_with_inner_state_kept(shards):
    """H = 4, inner Adam, outer Nesterov SGD: the same weights as DiLoCo written out in torch
    (the workers' Adam moments persist across outer steps; the shards average, then step)."""
    steps, h = 12, 4
    expected = reference_diloco(steps, h, workers=2, outer_lr=0.7)
    models = train_workers(
        [s.address for s in shards(2)],
        steps,
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
        mode="diloco",
        local_steps=h,
        outer=SGD(lr=0.7, momentum=0.9, nesterov=True),
        split_bytes=256,
    )
    assert_close(models[0], expected, 1e-5)
    assert_close(models[1], expected, 1e-5)


def test_a_worker_that_leaves_between_outer_steps_drops_out_of_the_average(shards):
    """Synchronous outer steps, 3 workers, H = 2: worker 2 leaves (its client closes) after
    its second outer step; the outer steps after it average workers 0 and 1 only, exactly as
    DiLoCo written out in torch with the worker gone, and nobody waits for it."""
    steps, h, workers, leaves_after = 8, 2, 3, 4
    expected = reference_diloco(
        steps, h, workers, 0.7, live=lambda t: range(workers if t < leaves_after else workers - 1)
    )
    three = reference_diloco(steps, h, workers, outer_lr=0.7)  # had it stayed: it differs
    addrs = [s.address for s in shards(2)]
    x, y = data(steps * workers * BATCH)
    models = {i: make_model(0 if i == 0 else 100 + i) for i in range(workers)}

    def worker(i: int):
        def run():
            job = dict(mode="diloco", local_steps=h, split_bytes=256)
            with psworker.connect(addrs, worker_id=i, num_workers=workers, **job) as c:
                opt = DistributedOptimizer(
                    models[i], c, torch.optim.Adam(models[i].parameters(), lr=0.01)
                )
                for t in range(leaves_after if i == workers - 1 else steps):
                    opt.zero_grad()
                    s = batch_of(i, t, workers)
                    loss_of(models[i], x[s], y[s]).backward()
                    opt.step()

        return run

    run_workers([worker(i) for i in range(workers)], timeout=60)
    assert_close(models[0], expected, 1e-5)
    assert_close(models[1], expected, 1e-5)
    differs = max(
        (u - v).abs().max().item()
        for u, v in zip(expected.state_dict().values(), three.state_dict().values(), strict=True)
    )
    assert differs > 1e-3  # the comparison can fail: the leave changed the weights


@pytest.mark.timeout(120)
def test_a_worker_that_joins_an_elastic_job_between_outer_steps_starts_from_its_weights(shards):
    """Synchronous outer steps, elastic 2:3, H = 2: worker 2 joins while the founders hold
    outer step 1 open, takes inner steps 4-7 (outer steps 2 and 3) from the job's weights, and
    leaves; the weights match DiLoCo written out in torch with that membership."""
    steps, h, joins, leaves = 10, 2, 4, 8
    servers = shards(2)
    addrs = [s.address for s in servers]
    x, y = data(steps * 3 * BATCH)
    models = {i: make_model(0 if i == 0 else 100 + i) for i in range(3)}
    ready = threading.Barrier(3, timeout=30)  # the founders hold outer step 1 open
    job = dict(mode="diloco", local_steps=h, split_bytes=256, elastic="2:3", timeout=30)

    def joined() -> bool:
        return all(
            ("joined", 2) in {(e.kind, e.worker) for e, _ in s.shard.status().history}
            for s in servers
        )

    def train(i: int, first: int, last: int) -> None:
        with psworker.connect(addrs, worker_id=i, **job) as c:
            opt = DistributedOptimizer(
                models[i], c, torch.optim.Adam(models[i].parameters(), lr=0.01)
            )
            for t in range(first, last):
                if i < 2 and t == joins - 1:  # before the push that closes outer step 1
                    ready.wait()
                    deadline = time.monotonic() + 30
                    while not joined():
                        assert time.monotonic() < deadline, "worker 2 never joined"
                        time.sleep(0.02)
                opt.zero_grad()
                s = batch_of(i, t, 3)
                loss_of(models[i], x[s], y[s]).backward()
                opt.step()
            if i == 2:
                assert c.step == last, c.step  # inner steps counted from the outer step it joined

    def joiner() -> None:
        ready.wait()
        train(2, joins, leaves)

    run_workers([lambda: train(0, 0, steps), lambda: train(1, 0, steps), joiner], timeout=90)
    expected = reference_diloco(
        steps, h, 3, 0.7, live=lambda t: [0, 1, 2] if joins <= t < leaves else [0, 1]
    )
    assert_close(models[0], expected, 1e-5)
    assert_close(models[1], expected, 1e-5)
    without = reference_diloco(steps, h, 3, 0.7, live=lambda t: [0, 1])  # worker 2 never came
    differs = max(
        (u - v).abs().max().item()
        for u, v in zip(expected.state_dict().values(), without.state_dict().values(), strict=True)
    )
    assert differs > 1e-3  # the comparison can fail: the joiner changed the weights


def test_async_outer_steps_run_delayed_nesterov_on_the_shards(shards):
    """outer_sync=False: the shards run the outer Nesterov SGD as delayed Nesterov with delay
    = the number of workers, and training moves the weights."""
    servers = shards(1)
    models = train_workers(
        [s.address for s in servers],
        8,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        mode="diloco",
        local_steps=2,
        outer_sync=False,
    )
    job = servers[0].shard.status().job
    assert job.mode == "async"
    assert job.optimizer.name == "delayed_nesterov"
    assert job.optimizer.delay == 2
    for model in models.values():
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_pseudo_gradients_halve_the_bytes_sent(shards):
    """compression='fp16' sends pseudo-gradients in 16 bits: half the bytes, counted."""
    sent = {}
    weights = {}
    for compression in (None, "fp16"):
        addrs = [s.address for s in shards(1)]
        model = make_model(0)
        x, y = data(6 * BATCH)
        with psworker.connect(
            addrs,
            worker_id=0,
            num_workers=1,
            mode="diloco",
            local_steps=3,
            compression=compression,
        ) as client:
            assert isinstance(client, DiLoCoClient)
            opt = DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
            assert isinstance(opt, DiLoCoOptimizer) and not opt.overlapping
            for t in range(6):
                opt.zero_grad()
                loss_of(model, x[batch_of(0, t, 1)], y[batch_of(0, t, 1)]).backward()
                opt.step()
            assert client.step == 6 and client.outer.step == 2
            sent[compression] = client.bytes_sent
            weights[compression] = model
    params = sum(p.numel() for p in make_model(0).parameters())
    assert sent[None] == 2 * 4 * params  # two outer steps of float32 pseudo-gradients
    assert sent["fp16"] == 2 * 2 * params
    assert_close(weights["fp16"], weights[None], 1e-3)


def test_workers_that_disagree_on_local_steps_or_inner_optimizer_are_refused(shards):
    addrs = [s.address for s in shards(1)]
    model = make_model(0)
    with psworker.connect(addrs, worker_id=0, num_workers=2, mode="diloco", local_steps=4) as chief:
        DistributedOptimizer(model, chief, torch.optim.SGD(model.parameters(), lr=0.1))
        for h, lr, fragments, said in (
            (7, 0.1, 1, "local_steps=7"),
            (4, 0.2, 1, "lr=0.2"),
            (4, 0.1, 2, "fragments=2"),
        ):
            other = make_model(0)
            with (
                psworker.connect(
                    addrs,
                    worker_id=1,
                    num_workers=2,
                    mode="diloco",
                    local_steps=h,
                    fragments=fragments,
                ) as client,
                pytest.raises(ModelMismatchError) as caught,
            ):
                DistributedOptimizer(other, client, torch.optim.SGD(other.parameters(), lr=lr))
            message = str(caught.value)
            assert "local steps (DiLoCo)" in message and said in message, message
        with psworker.connect(addrs, worker_id=1, num_workers=2, mode="sync") as plain:
            other = make_model(0)
            with pytest.raises(ModelMismatchError, match="worker sent none"):
                DistributedOptimizer(other, plain, psworker.SGD(lr=0.1))


def test_bad_settings_are_refused_before_anything_is_sent(shards):
    servers = shards(1)
    addrs = [s.address for s in servers]
    with pytest.raises(ConfigError, match="local_steps must be >= 1, got 0"):
        psworker.connect(addrs, worker_id=0, num_workers=1, mode="diloco", local_steps=0)
    with pytest.raises(ConfigError, match="apply to mode 'diloco' only"):
        psworker.connect(addrs, worker_id=0, num_workers=1, mode="sync", local_steps=4)
    for settings, said in (
        ({"local_steps": 6, "fragments": 4}, "fragments must divide local_steps"),
        ({"local_steps": 6, "fragments": 2, "overlap_steps": 3}, "below local_steps/fragments"),
        ({"local_steps": 6, "overlap_steps": -1}, "overlap_steps must be >= 0"),
        ({"local_steps": 6, "mix": 1.0}, r"mix must be in \[0, 1\)"),
        (
            {"local_steps": 6, "fragments": 2, "outer_sync": False, "dynamic_local_steps": True},
            "cannot be combined with fragments",
        ),
    ):
        with pytest.raises(ConfigError, match=said):
            psworker.connect(addrs, worker_id=0, num_workers=1, mode="diloco", **settings)
    two = torch.nn.Linear(2, 1)
    with (
        psworker.connect(
            addrs, worker_id=0, num_workers=1, mode="diloco", local_steps=3, fragments=3
        ) as client,
        pytest.raises(ConfigError, match="fragments=3 needs at least as many trained"),
    ):
        DistributedOptimizer(two, client, torch.optim.SGD(two.parameters(), lr=0.1))
    client = psworker.connect(addrs, worker_id=0, num_workers=1, mode="diloco")
    with client, pytest.raises(ConfigError, match="the shards run the outer optimizer"):
        client.init({"w": torch.zeros(2).numpy()}, psworker.Adam(lr=0.1))
    assert not servers[0].shard.status().initialized


def test_a_shard_restarted_from_its_checkpoint_replays_pseudo_gradients_bit_identically():
    """kill -9 of a shard between outer steps: restarted from the checkpoint of outer step 1,
    it gets outer step 2's pseudo-gradient replayed by the worker and ends with the same
    weights, bit for bit, as a run without the fault."""
    x, y = data(8 * BATCH)

    def run(fault: bool) -> torch.nn.Module:
        server = served(Shard(LIMITS))
        port = int(server.address.rsplit(":", 1)[1])
        model = make_model(0)
        state = None
        try:
            with psworker.connect(
                [server.address],
                worker_id=0,
                num_workers=1,
                mode="diloco",
                local_steps=2,
                timeout=10,
                retry_s=10,
                heartbeat_s=0,
            ) as client:
                opt = DistributedOptimizer(model, client, torch.optim.Adam(model.parameters()))
                for t in range(8):
                    opt.zero_grad()
                    loss_of(model, x[batch_of(0, t, 1)], y[batch_of(0, t, 1)]).backward()
                    opt.step()
                    if fault and client.outer.step == 1 and state is None:
                        state = server.shard.export_state()
                        assert state is not None
                        server.shard.mark_checkpoint(state)
                    if fault and t == 5:  # outer step 2 (t = 3) is gone with the old process
                        server.stop(grace=0)
                        shard = Shard(LIMITS)
                        shard.restore(state)
                        server = served(shard, port)
                assert client.outer.step == 4
                if fault:
                    assert client.outer.links[0].recoveries == 1
        finally:
            server.stop(grace=0)
        return model

    clean, recovered = run(False), run(True)
    for (name, a), b in zip(
        clean.state_dict().items(), recovered.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_step_grad_scaler_skips_is_not_an_inner_step(shards):
    """GradScaler works on the inner optimizer: a step with inf gradients is skipped by the
    scaler, not counted towards H, and nothing non-finite reaches the shards."""
    addrs = [s.address for s in shards(1)]
    model = make_model(0)
    x, y = data(4 * BATCH)
    with psworker.connect(
        addrs, worker_id=0, num_workers=1, mode="diloco", local_steps=3
    ) as client:
        opt = DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu")
        for t in range(4):
            opt.zero_grad()
            loss = loss_of(model, x[batch_of(0, t, 1)], y[batch_of(0, t, 1)])
            scaler.scale(loss * (float("inf") if t == 1 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
        assert (client.step, client.outer.step) == (3, 1)
        assert all(torch.isfinite(p).all() for p in model.parameters())


class StepClock:
    """A worker's clock for dynamic local steps: each inner step takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.now = 0.0
        self.seconds = seconds

    def __call__(self) -> float:
        return self.now


def test_dynamic_local_steps_give_a_worker_half_as_fast_half_the_steps(shards):
    """Asynchronous outer steps with DyLU on two real shards: every worker starts with H; a
    worker that takes twice as long per inner step hears the faster one's pace through the
    shards after its outer step and takes H/2 next, the fast one keeps H; every outer step is
    applied."""
    import numpy as np

    from psworker.diloco import OuterSteps

    servers = shards(2)
    addrs = [s.address for s in servers]
    h = 8
    clients = [
        psworker.connect(
            addrs,
            worker_id=w,
            num_workers=2,
            mode="diloco",
            local_steps=h,
            outer_sync=False,
            dynamic_local_steps=True,
            heartbeat_s=0,
        )
        for w in range(2)
    ]
    start = {"w": np.zeros(1000, np.float32), "b": np.zeros(3, np.float32)}
    clocks = [StepClock(1.0), StepClock(2.0)]
    steps = []
    for w, client in enumerate(clients):
        client.declare("SGD[{lr=0.1}]")
        client.init(start)
        steps.append(OuterSteps(client, client.pull(), clock=clocks[w]))

    def period(w: int) -> int:
        """Worker w's inner steps until its outer step; how many it took."""
        taken = 0
        local = {n: a - 0.01 * (w + 1) for n, a in steps[w].start.items()}
        while True:
            clocks[w].now += clocks[w].seconds
            taken += 1
            if steps[w].inner_step():
                steps[w].outer_step(lambda names: {n: local[n] for n in names})
                return taken

    try:
        assert period(0) == h  # the fast worker's first: it says 1 s a step
        assert period(1) == h  # the slow one starts with H too, then hears 1 s
        assert steps[1].due == h // 2 and steps[0].due == h
        assert period(1) == h // 2
        assert period(0) == h  # the fastest keeps H
        assert [c.outer.step for c in clients] == [2, 2]
        assert servers[0].shard.status().pushes_applied == 4
        assert clients[1].step == h + h // 2
    finally:
        for client in clients:
            client.close()


def test_a_worker_without_dynamic_local_steps_is_refused_by_a_job_with_them(shards):
    addrs = [s.address for s in shards(1)]
    model = make_model(0)
    common = dict(num_workers=2, mode="diloco", local_steps=4, outer_sync=False)
    with psworker.connect(addrs, worker_id=0, dynamic_local_steps=True, **common) as chief:
        DistributedOptimizer(model, chief, torch.optim.SGD(model.parameters(), lr=0.1))
        other = make_model(0)
        with (
            psworker.connect(addrs, worker_id=1, **common) as client,
            pytest.raises(ModelMismatchError, match="dynamic_local_steps=True"),
        ):
            DistributedOptimizer(other, client, torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_pace_that_is_no_duration_is_refused_over_grpc(shards):
    import math

    from pswire.errors import InvalidRequestError

    servers = shards(1)
    with psworker.connect(
        [servers[0].address], worker_id=0, num_workers=1, mode="diloco", outer_sync=False
    ) as client:
        model = make_model(0)
        DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
        assert client.pace(0.25) == 0.25
        with pytest.raises(InvalidRequestError, match=r"seconds_per_step must be .* got nan"):
            client.pace(math.nan)
        assert client.pace(0.0) == 0.25  # the refused one changed nothing


def test_synchronize_takes_the_outer_step_for_the_steps_since_the_last(shards):
    """A script that stops between outer steps calls synchronize(): its last inner steps
    reach the job (an outer step with fewer local steps); with none pending it does nothing."""
    addrs = [s.address for s in shards(1)]
    model = make_model(0)
    x, y = data(7 * BATCH)
    with psworker.connect(
        addrs, worker_id=0, num_workers=1, mode="diloco", local_steps=5
    ) as client:
        opt = DistributedOptimizer(model, client, torch.optim.SGD(model.parameters(), lr=0.1))
        for t in range(7):
            opt.zero_grad()
            loss_of(model, x[batch_of(0, t, 1)], y[batch_of(0, t, 1)]).backward()
            opt.step()
        assert client.outer.step == 1
        local = {k: v.clone() for k, v in model.state_dict().items()}
        opt.synchronize()
        assert client.outer.step == 2
        sent = client.bytes_sent
        opt.synchronize()
        assert (client.outer.step, client.bytes_sent) == (2, sent)
        # Outer SGD lr 0.7 with momentum on the two steps' pseudo-gradient: the model moved
        # from the local weights to the job's new ones.
        moved = max((model.state_dict()[k] - v).abs().max().item() for k, v in local.items())
        assert moved > 1e-4
