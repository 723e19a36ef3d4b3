"""DistributedOptimizer wrapping torch optimizers, each run against plain torch on the same seed
and data: every supported class with two parameter groups and a scheduler, in local, sync (1
and 2 workers) and allreduce; lr 0 freezes the shards; state_dict round trips; refusals."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

STEPS, BATCH = 32, 8  # 2 workers x BATCH each == torch with 2 * BATCH


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def data(n: int = STEPS * 2 * BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def split(model: torch.nn.Module) -> tuple[list, list]:
    """(weights, biases): two parameter groups, as scripts keep biases out of weight decay."""
    named = list(model.named_parameters())
    return [p for n, p in named if n.endswith("weight")], [p for n, p in named if "bias" in n]


def sgd(m):
    w, b = split(m)
    groups = [{"params": w, "weight_decay": 0.01, "dampening": 0.1}, {"params": b, "lr": 0.05}]
    groups[1]["nesterov"] = True
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def adam(m):
    w, b = split(m)
    return torch.optim.Adam(
        [
            {"params": w, "weight_decay": 0.01},
            {"params": b, "lr": 0.02, "betas": (0.8, 0.99), "amsgrad": True},
        ],
        lr=0.01,
    )


def adamw(m):
    w, b = split(m)
    return torch.optim.AdamW(
        [{"params": w, "weight_decay": 0.1, "amsgrad": True}, {"params": b, "weight_decay": 0.0}],
        lr=0.01,
    )


def adagrad(m):
    w, b = split(m)
    return torch.optim.Adagrad(
        [{"params": w, "lr_decay": 0.01, "weight_decay": 0.01}, {"params": b, "eps": 1e-6}],
        lr=0.1,
        initial_accumulator_value=0.1,
    )


def rmsprop(m):
    w, b = split(m)
    return torch.optim.RMSprop(
        [
            {"params": w, "momentum": 0.9, "centered": True},
            {"params": b, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.01},
        ],
        lr=0.01,
    )


def adadelta(m):
    w, b = split(m)
    return torch.optim.Adadelta(
        [{"params": w, "weight_decay": 0.01}, {"params": b, "rho": 0.8, "eps": 1e-4}], lr=4.0
    )


def adamax(m):
    w, b = split(m)
    return torch.optim.Adamax(
        [{"params": w, "weight_decay": 0.01}, {"params": b, "lr": 0.03, "betas": (0.8, 0.99)}],
        lr=0.02,
    )


def nadam(m):
    w, b = split(m)
    return torch.optim.NAdam(
        [
            {"params": w, "weight_decay": 0.1, "decoupled_weight_decay": True},
            {"params": b, "weight_decay": 0.01, "momentum_decay": 0.01, "betas": (0.8, 0.99)},
        ],
        lr=0.01,
    )


def radam(m):
    w, b = split(m)
    return torch.optim.RAdam(
        [
            {"params": w, "weight_decay": 0.1, "decoupled_weight_decay": True},
            {"params": b, "weight_decay": 0.01, "betas": (0.8, 0.9)},
        ],
        lr=0.05,
    )


OPTIMIZERS: dict[str, Callable] = {
    "sgd": sgd,
    "adam": adam,
    "adamw": adamw,
    "adagrad": adagrad,
    "rmsprop": rmsprop,
    "adadelta": adadelta,
    "adamax": adamax,
    "nadam": nadam,
    "radam": radam,
}


def schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.6)  # lr changes every 5


def loss_at(model, x, y, lo: int, hi: int):
    return torch.nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi])


def torch_run(make_opt, steps: int = STEPS, start=None):
    """Plain torch, batch 2 * BATCH per step: the reference."""
    x, y = data()
    model = make_model(0)
    opt = make_opt(model)
    sched = schedule(opt)
    begin = 0
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
        sched.load_state_dict(start["sched"])
        begin = start["step"]
    for t in range(begin, steps):
        opt.zero_grad()
        loss_at(model, x, y, 2 * BATCH * t, 2 * BATCH * (t + 1)).backward()
        opt.step()
        sched.step()
    return model, opt, sched


def train(opt, sched, model, rank: int, workers: int, steps: range) -> None:
    """Each of ``workers`` takes its share of the 2 * BATCH examples of every step."""
    x, y = data()
    share = 2 * BATCH // workers
    for t in steps:
        opt.zero_grad()
        lo = 2 * BATCH * t + rank * share
        loss_at(model, x, y, lo, lo + share).backward()
        opt.step()
        sched.step()


def connector(mode: str, workers: int, shards) -> Callable:
    """``connect(i)`` for worker i of a job in ``mode`` ("local", "sync*", "allreduce")."""
    if mode.startswith("sync"):
        addrs = [s.address for s in shards(2)]
        # split_bytes 64: the larger weight is cut across both shards, keeping its group.
        connect = lambda i: psworker.connect(  # noqa: E731
            addrs, worker_id=i, num_workers=workers, mode="sync", split_bytes=64
        )
    elif mode == "allreduce":
        from psworker.ring.ring import RingServer

        servers = [RingServer("127.0.0.1:0") for _ in range(workers)]
        peers = [s.address for s in servers]
        connect = lambda i: psworker.connect(  # noqa: E731
            peers, worker_id=i, mode="allreduce", server=servers[i], timeout=20
        )
    else:
        connect = lambda i: psworker.connect(mode="local")  # noqa: E731
    return connect


def run_mode(mode: str, make_opt, shards) -> list[torch.nn.Module]:
    """Trains STEPS steps in ``mode`` ("local", "sync1", "sync2", "allreduce"); the models of
    every worker."""
    workers = 1 if mode in ("local", "sync1") else 2
    models = [make_model(0 if i == 0 else 100 + i) for i in range(workers)]  # worker 0's win
    connect = connector(mode, workers, shards)

    def worker(i: int):
        def run():
            with connect(i) as client:
                opt = DistributedOptimizer(models[i], client, make_opt(models[i]))
                assert isinstance(opt, torch.optim.Optimizer)
                train(opt, schedule(opt), models[i], i, workers, range(STEPS))

        return run

    run_workers([worker(i) for i in range(workers)])
    return models


def assert_close(model, reference, what: str, tol: float = 1e-5) -> None:
    for (name, a), b in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        diff = (a - b).abs().max().item()
        assert diff < tol, f"{what} {name}: max abs diff {diff}"


@pytest.mark.parametrize("mode", ["local", "sync1", "sync2", "allreduce"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_class_with_two_groups_and_a_scheduler_matches_torch(shards, name, mode):
    reference, _, _ = torch_run(OPTIMIZERS[name])
    start = make_model(0)
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(reference.parameters(), start.parameters(), strict=True)
    )
    assert moved > 0.05  # the comparison below is not vacuous
    for i, model in enumerate(run_mode(mode, OPTIMIZERS[name], shards)):
        assert_close(model, reference, f"{name} {mode} worker {i}")


def test_a_scheduler_setting_lr_zero_from_step_k_freezes_the_shards(shards):
    k = 6
    servers = shards(2)
    addrs = [s.address for s in servers]
    models = [make_model(0), make_model(0)]
    initial, frozen = {}, {}

    def worker(i: int):
        def run():
            with psworker.connect(
                addrs, worker_id=i, num_workers=2, mode="sync", split_bytes=64
            ) as client:
                opt = DistributedOptimizer(models[i], client, adamw(models[i]))
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < k else 0.0)
                if i == 0:
                    initial.update({j: s.shard.snapshot() for j, s in enumerate(servers)})
                train(opt, sched, models[i], i, 2, range(k))
                if i == 0:
                    frozen.update({j: s.shard.snapshot() for j, s in enumerate(servers)})
                train(opt, sched, models[i], i, 2, range(k, STEPS))
                assert opt.param_groups[0]["lr"] == 0.0

        return run

    run_workers([worker(0), worker(1)])
    for j, server in enumerate(servers):
        after = server.shard.snapshot()
        assert server.shard.status().clock == STEPS
        for key, value in frozen[j].items():
            assert (after[key] == value).all(), f"shard {j} '{key}' moved after lr became 0"
    # Before k they did move: every variable on every shard.
    for j, values in initial.items():
        for key, value in values.items():
            assert (frozen[j][key] != value).any(), f"shard {j} '{key}' never moved"


@pytest.mark.parametrize(
    ("name", "slots"),
    [
        ("adamw", {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
        ("nadam", {"step", "mu_product", "exp_avg", "exp_avg_sq"}),
    ],
)
def test_state_dict_continues_in_plain_torch_exactly(shards, name, slots):
    make = OPTIMIZERS[name]
    k = 12
    addrs = [s.address for s in shards(2)]
    models = [make_model(0), make_model(5)]
    saved = {}

    def worker(i: int):
        def run():
            with psworker.connect(
                addrs, worker_id=i, num_workers=2, mode="sync", split_bytes=64
            ) as client:
                opt = DistributedOptimizer(models[i], client, make(models[i]))
                sched = schedule(opt)
                train(opt, sched, models[i], i, 2, range(k))
                if i == 0:
                    buf = io.BytesIO()
                    torch.save(
                        {
                            "model": models[i].state_dict(),
                            "optimizer": opt.state_dict(),
                            "sched": sched.state_dict(),
                            "step": k,
                        },
                        buf,
                    )
                    saved["bytes"] = buf.getvalue()

        return run

    run_workers([worker(0), worker(1)])
    ckpt = torch.load(io.BytesIO(saved["bytes"]))
    assert set(ckpt["optimizer"]["state"][0]) == slots
    resumed, _, _ = torch_run(make, start=ckpt)
    uninterrupted, _, _ = torch_run(make)
    assert_close(resumed, uninterrupted, "dist -> torch")


@pytest.mark.parametrize("name", ["adamw", "nadam"])
@pytest.mark.parametrize("mode", ["sync2", "allreduce", "local"])
def test_a_torch_state_dict_resumes_distributed_exactly(shards, mode, name):
    make = OPTIMIZERS[name]
    k = 12
    _, opt, sched = torch_run(make, steps=k)
    model_k, _, _ = torch_run(make, steps=k)
    buf = io.BytesIO()
    torch.save(
        {"model": model_k.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()},
        buf,
    )
    workers = 1 if mode == "local" else 2
    connect = connector(mode, workers, shards)
    models = [make_model(3), make_model(4)][:workers]

    def worker(i: int):
        def run():
            ckpt = torch.load(io.BytesIO(buf.getvalue()))
            if i == 1:  # worker 1 loads the model first; worker 0 after wrapping (either works)
                models[i].load_state_dict(ckpt["model"])
            with connect(i) as client:
                opt = DistributedOptimizer(models[i], client, make(models[i]))
                if i == 0:
                    models[i].load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
                sched = schedule(opt)
                sched.load_state_dict(ckpt["sched"])
                train(opt, sched, models[i], i, workers, range(k, STEPS))

        return run

    run_workers([worker(i) for i in range(workers)])
    uninterrupted, _, _ = torch_run(make)
    for i, model in enumerate(models):
        assert_close(model, uninterrupted, f"torch -> dist worker {i}")


def test_the_optimizers_state_dict_carries_a_job_onto_another_shard_count(shards):
    """Export holds no optimizer state; ``opt.state_dict()`` does, in torch's form, which a
    job on any shard count loads: 2 shards (the larger weight split) then 3 end as torch."""
    make, k = OPTIMIZERS["adamw"], 12
    saved = io.BytesIO()
    for count, steps in ((2, range(k)), (3, range(k, STEPS))):
        addresses = [s.address for s in shards(count)]
        model = make_model(0)
        with psworker.connect(addresses, mode="sync", split_bytes=64) as client:
            opt = DistributedOptimizer(model, client, make(model))
            sched = schedule(opt)
            if steps.start:
                state = torch.load(io.BytesIO(saved.getvalue()))
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                sched.load_state_dict(state["sched"])
            train(opt, sched, model, 0, 1, steps)
            if not steps.start:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                torch.save({**state, "sched": sched.state_dict()}, saved)
    uninterrupted, _, _ = torch_run(make)
    assert_close(model, uninterrupted, "2 shards, then 3")


def test_a_worker_that_loaded_another_state_is_told(shards):
    _, opt_a, _ = torch_run(adam, steps=3)
    _, opt_b, _ = torch_run(adam, steps=4)
    states = [opt_a.state_dict(), opt_b.state_dict()]
    addrs = [s.address for s in shards(1)]
    errors: dict[int, BaseException] = {}

    def worker(i: int):
        def run():
            model = make_model(0)
            with psworker.connect(
                addrs, worker_id=i, num_workers=2, mode="sync", timeout=20
            ) as client:
                opt = DistributedOptimizer(model, client, adam(model))
                try:
                    opt.load_state_dict(states[i])
                except psworker.ModelMismatchError as exc:
                    errors[i] = exc

        return run

    run_workers([worker(0), worker(1)])
    assert list(errors) == [1]
    assert "worker 1 loaded another optimizer state than worker 0" in str(errors[1])


class NotAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize(
    ("make", "detail"),
    [
        (lambda p: torch.optim.ASGD(p), r"torch\.optim\.asgd\.ASGD is not supported"),
        (lambda p: torch.optim.Rprop(p), r"Rprop is not supported.*Adadelta.*NAdam.*RAdam"),
        (lambda p: torch.optim.NAdam(p, maximize=True), r"torch\.optim\.NAdam .*maximize"),
        (lambda p: torch.optim.RAdam(p, capturable=True), r"RAdam .*capturable"),
        (lambda p: NotAdam(p), r"NotAdam is not supported"),
        (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), r"torch\.optim\.SGD .*maximize"),
        (lambda p: torch.optim.Adam(p, capturable=True), r"torch\.optim\.Adam .*capturable"),
        (lambda p: torch.optim.AdamW(p, maximize=True), r"torch\.optim\.AdamW .*maximize"),
        (lambda p: torch.optim.RMSprop(p, differentiable=True), r"RMSprop .*differentiable"),
        (lambda p: torch.optim.Adagrad(p, maximize=True), r"Adagrad .*maximize"),
    ],
)
def test_unsupported_class_or_option_is_refused_before_anything_is_sent(shards, make, detail):
    (server,) = shards(1)
    model = make_model(0)
    with (
        psworker.connect([server.address], worker_id=0, num_workers=1, mode="sync") as client,
        pytest.raises(ValueError, match=detail),
    ):
        DistributedOptimizer(model, client, make(model.parameters()))
    status = server.shard.status()
    assert status.job is None and not status.workers  # nothing reached the shard


def test_kernel_flags_are_accepted_and_change_nothing():
    reference, _, _ = torch_run(adam)

    def flagged(m):
        opt = adam(m)
        for g in opt.param_groups:
            g["foreach"] = True
        return opt

    (model,) = run_mode("local", flagged, None)
    assert_close(model, reference, "foreach")


def test_a_layout_change_mid_training_is_refused_before_the_push():
    model = make_model(0)
    x, y = data()
    with psworker.connect(mode="local") as client:
        opt = DistributedOptimizer(model, client, adam(model))
        opt.param_groups[0]["amsgrad"] = True
        loss_at(model, x, y, 0, BATCH).backward()
        with pytest.raises(ValueError, match=r"parameter group 0: \{'amsgrad': 1\.0\}"):
            opt.step()
        assert client.step == 0
        opt.param_groups[0]["amsgrad"] = False
        opt.param_groups[1]["lr"] = -1.0
        with pytest.raises(ValueError, match=r"parameter group 1: invalid lr: -1\.0"):
            opt.step()
        assert client.step == 0


class TableModel(torch.nn.Module):
    def __init__(self, client) -> None:
        super().__init__()
        from psworker.torch import Embedding

        torch.manual_seed(0)
        self.emb = Embedding(20, 4, client, "emb", init_scale=0.1)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def test_an_embedding_table_joins_the_group_holding_its_handle(shards):
    servers = shards(2)
    ids = torch.randint(0, 20, (8, 5), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    with psworker.connect([s.address for s in servers], worker_id=0, num_workers=1) as client:
        model = TableModel(client)
        assert "emb.handle" not in model.state_dict()  # the rows live on the shards
        decay = [model.out.weight]
        rest = [model.out.bias, model.emb.handle]
        opt = DistributedOptimizer(
            model,
            client,
            torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                lr=0.05,
            ),
        )
        before = client.pull_rows("emb", ids.unique().numpy())
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(ids), labels).backward()
            opt.step()
        assert (client.pull_rows("emb", ids.unique().numpy()) != before).all()
    for server in servers:
        specs = server.shard.status().job.specs
        assert specs["emb"].group == 1
        assert server.shard.status().job.optimizer_of("emb") == psworker.AdamW(
            lr=0.05, weight_decay=0.0
        )


def test_a_table_in_a_weight_decay_group_is_refused():
    with psworker.connect(mode="local") as client:
        model = TableModel(client)
        with pytest.raises(psworker.InvalidRequestError, match=r"table 'emb': weight_decay 0\.01"):
            DistributedOptimizer(model, client, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("kind", [torch.optim.Adadelta, torch.optim.NAdam, torch.optim.RAdam])
def test_a_table_under_an_optimizer_without_a_sparse_form_is_refused(shards, kind):
    (server,) = shards(1)
    with psworker.connect([server.address], worker_id=0, num_workers=1, mode="sync") as client:
        model = TableModel(client)
        with pytest.raises(
            psworker.InvalidRequestError,
            match=r"table 'emb': optimizer '\w+' has no row-sparse form",
        ):
            DistributedOptimizer(model, client, kind(model.parameters()))
    assert server.shard.status().job is None  # refused: nothing installed


SCHEDULERS = {
    # momentum cycling: OneCycleLR sets each group's momentum (SGD) or betas[0] (Adam) too
    "onecycle-sgd": (
        sgd,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=STEPS),
    ),
    "onecycle-adamw": (
        adamw,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=STEPS),
    ),
    "cosine": (rmsprop, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)),
    "warmup-cosine": (
        adam,
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - 4),
            ],
            milestones=[4],
        ),
    ),
    "plateau": (
        adagrad,
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    ),
}


def scheduled(opt, sched, model, rank: int, workers: int) -> list[float]:
    """Trains STEPS steps with ``sched``; each step's lr of group 0 (and momentum/betas)."""
    x, y = data()
    share = 2 * BATCH // workers
    seen = []
    for t in range(STEPS):
        opt.zero_grad()
        lo = 2 * BATCH * t + rank * share
        loss_at(model, x, y, lo, lo + share).backward()
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            # A metric every worker agrees on: the whole batch's loss on the (same) weights.
            with torch.no_grad():
                sched.step(loss_at(model, x, y, 2 * BATCH * t, 2 * BATCH * (t + 1)).item())
        else:
            sched.step()
        group = opt.param_groups[0]
        seen.append((group["lr"], group.get("momentum"), group.get("betas")))
    return seen


@pytest.mark.parametrize("mode", ["local", "sync2"])
@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_every_scheduler_reaches_the_shards(shards, kind, mode):
    make_opt, make_sched = SCHEDULERS[kind]
    model = make_model(0)
    opt = make_opt(model)
    want = scheduled(opt, make_sched(opt), model, 0, 1)
    assert len({lr for lr, _, _ in want}) > 2  # the schedule really changes lr
    workers = 1 if mode == "local" else 2
    connect = connector(mode, workers, shards)
    models = [make_model(0) for _ in range(workers)]
    seen: dict[int, list] = {}

    def worker(i: int):
        def run():
            with connect(i) as client:
                opt = DistributedOptimizer(models[i], client, make_opt(models[i]))
                seen[i] = scheduled(opt, make_sched(opt), models[i], i, workers)

        return run

    run_workers([worker(i) for i in range(workers)])
    for i in range(workers):
        assert seen[i] == want
        assert_close(models[i], model, f"{kind} {mode} worker {i}")
