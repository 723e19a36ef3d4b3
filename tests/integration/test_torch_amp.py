"""torch.amp.GradScaler through DistributedOptimizer, against plain torch: a step whose gradients
hold inf/NaN is skipped as torch skips it (sync: by every worker, none waiting forever; async:
only that push), and the scale follows torch's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_torch_optim import BATCH, adamw, data, loss_at, make_model  # noqa: E402
from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

STEPS, INF_AT = 16, 5


def scaler() -> torch.amp.GradScaler:
    # A short growth interval, so the scale both grows and backs off within the run.
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)


def scaled_step(opt, grad_scaler, model, lo: int, hi: int, poison: bool) -> None:
    x, y = data()
    opt.zero_grad()
    loss = loss_at(model, x, y, lo, hi)
    if poison:
        loss = loss * float("inf")  # inf/NaN in every gradient of this batch
    grad_scaler.scale(loss).backward()
    grad_scaler.step(opt)
    grad_scaler.update()


def torch_reference() -> tuple[torch.nn.Module, list[float]]:
    model = make_model(0)
    opt, grad_scaler, scales = adamw(model), scaler(), []
    for t in range(STEPS):
        scaled_step(opt, grad_scaler, model, 2 * BATCH * t, 2 * BATCH * (t + 1), t == INF_AT)
        scales.append(grad_scaler.get_scale())
    return model, scales


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 64], ids=["one-message-steps", "streamed"])
def test_inf_on_one_of_two_sync_workers_skips_the_step_for_both(shards, chunk_bytes):
    reference, want = torch_reference()
    assert want[INF_AT] == want[INF_AT - 1] / 2  # torch halves the scale at the skip
    addrs = [s.address for s in shards(2)]
    models = [make_model(0), make_model(1)]
    scales: dict[int, list[float]] = {0: [], 1: []}
    skipped: dict[int, list[bool]] = {0: [], 1: []}

    def worker(i: int):
        def run():
            with psworker.connect(
                addrs,
                worker_id=i,
                num_workers=2,
                mode="sync",
                split_bytes=64,
                timeout=30,
                chunk_bytes=chunk_bytes,  # 64: every step a streamed Push, then a Pull
            ) as client:
                opt = DistributedOptimizer(models[i], client, adamw(models[i]))
                grad_scaler = scaler()
                for t in range(STEPS):
                    lo = 2 * BATCH * t + i * BATCH
                    # Only worker 1's gradients hold inf at INF_AT.
                    scaled_step(opt, grad_scaler, models[i], lo, lo + BATCH, i == 1 and t == INF_AT)
                    scales[i].append(grad_scaler.get_scale())
                    skipped[i].append(client.last_skipped)

        return run

    run_workers([worker(0), worker(1)], timeout=60)  # nobody waits forever
    for i in range(2):
        assert scales[i] == want, f"worker {i}'s scale"
        assert skipped[i] == [t == INF_AT for t in range(STEPS)], f"worker {i}"
        for (name, a), b in zip(
            models[i].state_dict().items(), reference.state_dict().values(), strict=True
        ):
            assert (a - b).abs().max().item() < 1e-5, f"worker {i} {name}"


@pytest.mark.parametrize("mode", ["local", "allreduce"])
def test_a_skip_matches_torch_without_shards(mode):
    reference, want = torch_reference()
    workers = 1 if mode == "local" else 2
    models = [make_model(i) for i in range(workers)]
    scales: dict[int, list[float]] = {i: [] for i in range(workers)}
    if mode == "allreduce":
        from psworker.ring.ring import RingServer

        servers = [RingServer("127.0.0.1:0") for _ in range(workers)]
        peers = [s.address for s in servers]

    def worker(i: int):
        def run():
            if mode == "local":
                client = psworker.connect(mode="local")
            else:
                client = psworker.connect(
                    peers, worker_id=i, mode="allreduce", server=servers[i], timeout=20
                )
            with client:
                opt = DistributedOptimizer(models[i], client, adamw(models[i]))
                grad_scaler = scaler()
                share = 2 * BATCH // workers
                for t in range(STEPS):
                    lo = 2 * BATCH * t + i * share
                    poison = t == INF_AT and i == workers - 1
                    scaled_step(opt, grad_scaler, models[i], lo, lo + share, poison)
                    scales[i].append(grad_scaler.get_scale())

        return run

    run_workers([worker(i) for i in range(workers)], timeout=60)
    for i in range(workers):
        assert scales[i] == want, f"{mode} worker {i}'s scale"
        for (name, a), b in zip(
            models[i].state_dict().items(), reference.state_dict().values(), strict=True
        ):
            assert (a - b).abs().max().item() < 1e-5, f"{mode} worker {i} {name}"


def test_in_async_only_the_poisoned_push_is_dropped(shards):
    (server,) = shards(1)
    models = [make_model(0), make_model(0)]
    with (
        psworker.connect([server.address], worker_id=0, num_workers=2, mode="async") as c0,
        psworker.connect([server.address], worker_id=1, num_workers=2, mode="async") as c1,
    ):
        opts = [DistributedOptimizer(m, c, adamw(m)) for m, c in zip(models, (c0, c1), strict=True)]
        scalers = [scaler(), scaler()]
        start = server.shard.snapshot()
        scaled_step(opts[1], scalers[1], models[1], 0, BATCH, poison=True)
        assert c1.last_skipped
        after_skip = server.shard.snapshot()
        assert all((after_skip[k] == v).all() for k, v in start.items())  # dropped
        assert scalers[1].get_scale() == 2.0**11  # the poisoned worker backs off
        scaled_step(opts[0], scalers[0], models[0], BATCH, 2 * BATCH, poison=False)
        assert not c0.last_skipped
        assert scalers[0].get_scale() == 2.0**12  # the other does not
        after = server.shard.snapshot()
        assert all((after[k] != v).any() for k, v in start.items())  # applied
        assert server.shard.status().clock == 2  # both pushes counted; one had no update
