"""Synchronous DiLoCo on the shards is the paper's algorithm: 4 workers and 2 real shards end
with the weights of DiLoCo written out in plain torch in one process (to 1e-6), and references
broken on purpose (plain momentum, inner state reset, summed or negated pseudo-gradients,
local weights kept) are told apart at that tolerance, so the comparison can fail."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from pscore.optim import SGD  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

WORKERS, H, STEPS, BATCH = 4, 3, 12, 8
OUTER_LR, MOMENTUM = 0.7, 0.9
TOLERANCE = 1e-6


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)
    )


def make_inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


X = torch.randn(STEPS * WORKERS * BATCH, 6, generator=torch.Generator().manual_seed(3))
Y = torch.randint(0, 3, (STEPS * WORKERS * BATCH,), generator=torch.Generator().manual_seed(4))


def loss_at(model: torch.nn.Module, worker: int, t: int) -> torch.Tensor:
    s = slice((t * WORKERS + worker) * BATCH, (t * WORKERS + worker + 1) * BATCH)
    return torch.nn.functional.cross_entropy(model(X[s]), Y[s])


@dataclass(frozen=True)
class Breakage:
    """What a deliberately wrong reference does differently (all False: the right one)."""

    plain_momentum: bool = False  # heavy-ball momentum instead of Nesterov
    reset_inner_state: bool = False  # AdamW's moments dropped at each outer step
    summed: bool = False  # the pseudo-gradients summed, not averaged
    negated: bool = False  # local minus global instead of global minus local
    keep_local: bool = False  # workers go on from their own weights, not the job's


def reference(broken: Breakage = Breakage()) -> torch.nn.Module:
    """DiLoCo in one process: each worker's AdamW on its own copy for H steps, then the mean
    pseudo-gradient (global - local) stepped by torch.optim.SGD(nesterov) on the global model,
    which every worker copies."""
    global_model = make_model(0)
    outer = torch.optim.SGD(
        global_model.parameters(),
        lr=OUTER_LR,
        momentum=MOMENTUM,
        nesterov=not broken.plain_momentum,
    )
    local = [make_model(0) for _ in range(WORKERS)]
    inner = [make_inner(m) for m in local]
    for t in range(STEPS):
        for w in range(WORKERS):
            inner[w].zero_grad()
            loss_at(local[w], w, t).backward()
            inner[w].step()
        if (t + 1) % H:
            continue
        with torch.no_grad():
            for g, *ps in zip(
                global_model.parameters(), *(m.parameters() for m in local), strict=True
            ):
                total = sum((p - g if broken.negated else g - p) for p in ps)
                g.grad = total if broken.summed else total / WORKERS
        outer.step()
        if broken.reset_inner_state:
            inner = [make_inner(m) for m in local]
        if not broken.keep_local:
            with torch.no_grad():
                for m in local:
                    for p, g in zip(m.parameters(), global_model.parameters(), strict=True):
                        p.copy_(g)
    return global_model


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (u - v).abs().max().item()
        for u, v in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def trained_on_shards(
    addresses: list[str], local_steps: int = H, **streaming: float
) -> tuple[list[torch.nn.Module], dict[int, dict]]:
    """4 worker threads in mode diloco (sync outer steps), each its own slice of the data:
    their models, and the job's weights each pulled at the end."""
    models = [make_model(0 if w == 0 else 50 + w) for w in range(WORKERS)]  # worker 0's start
    finals: dict[int, dict] = {}

    def worker(w: int):
        def run() -> None:
            with psworker.connect(
                addresses,
                worker_id=w,
                num_workers=WORKERS,
                mode="diloco",
                local_steps=local_steps,
                outer=SGD(lr=OUTER_LR, momentum=MOMENTUM, nesterov=True),
                split_bytes=256,  # the first layer's weight split across both shards
                **streaming,
            ) as client:
                opt = DistributedOptimizer(models[w], client, make_inner(models[w]))
                for t in range(STEPS):
                    opt.zero_grad()
                    loss_at(models[w], w, t).backward()
                    opt.step()
                opt.synchronize()  # lands an exchange in flight; no inner steps are left
                assert client.outer.step == STEPS // opt.local_steps
                assert client.step == STEPS
                finals[w] = client.pull()

        return run

    run_workers([worker(w) for w in range(WORKERS)])
    return models, finals


def test_four_workers_on_two_shards_match_diloco_written_out_in_torch(shards):
    expected = reference()
    moved = max_difference(expected, make_model(0))
    assert moved > 1e-2  # it trained
    models, _ = trained_on_shards([s.address for s in shards(2)])
    for w, model in enumerate(models):
        assert max_difference(model, expected) <= TOLERANCE, f"worker {w}"


@pytest.mark.parametrize(
    "broken",
    [
        Breakage(plain_momentum=True),
        Breakage(reset_inner_state=True),
        Breakage(summed=True),
        Breakage(negated=True),
        Breakage(keep_local=True),
    ],
    ids=lambda b: next(k for k, v in vars(b).items() if v),
)
def test_a_reference_broken_on_purpose_is_told_apart(broken):
    """Each mistake moves the weights by far more than the tolerance the shards are held to."""
    assert max_difference(reference(broken), reference()) > 100 * TOLERANCE


# Streaming DiLoCo: 2 fragments staggered by H/2, each exchange landing one inner step late,
# merged half and half with the local weights.
STREAM_H, FRAGMENTS, OVERLAP, MIX = 4, 2, 1, 0.5
FRAGMENT_NAMES = [["0.weight", "0.bias"], ["2.weight", "2.bias", "3.weight", "3.bias"]]


@dataclass(frozen=True)
class StreamBreakage:
    """What a deliberately wrong streaming reference does differently."""

    together: bool = False  # every fragment's outer step at once, every H steps
    no_overlap: bool = False  # the new weights land at once
    no_mix: bool = False  # the landed weights replace the local ones


def streaming_reference(broken: StreamBreakage = StreamBreakage()):
    """Streaming DiLoCo in one process: fragment f's outer step every H inner steps, the
    fragments' staggered by H/P; its new global values land OVERLAP steps later, merged as
    MIX * local + (1 - MIX) * global. Returns (the global model, the workers' models)."""
    spacing = STREAM_H if broken.together else STREAM_H // FRAGMENTS
    overlap = 0 if broken.no_overlap else OVERLAP
    mix = 0.0 if broken.no_mix else MIX
    global_model = make_model(0)
    params = dict(global_model.named_parameters())
    outer = torch.optim.SGD(params.values(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    local = [make_model(0) for _ in range(WORKERS)]
    inner = [make_inner(m) for m in local]
    pending: tuple[int, list[str], dict[str, torch.Tensor]] | None = None  # lands, names, values

    def land(names: list[str], values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for m in local:
                mine = dict(m.named_parameters())
                for n in names:
                    mine[n].copy_(mine[n] * mix + values[n] * (1.0 - mix) if mix else values[n])

    for t in range(STEPS):
        for w in range(WORKERS):
            inner[w].zero_grad()
            loss_at(local[w], w, t).backward()
            inner[w].step()
        done = t + 1
        if pending is not None and pending[0] == done:
            land(pending[1], pending[2])
            pending = None
        if done % spacing:
            continue
        index = done // spacing - 1
        names = (
            [n for part in FRAGMENT_NAMES for n in part]
            if broken.together
            else FRAGMENT_NAMES[index % FRAGMENTS]
        )
        with torch.no_grad():
            for n, g in params.items():
                g.grad = (
                    sum(g - dict(m.named_parameters())[n] for m in local) / WORKERS
                    if n in names
                    else None
                )
        outer.step()
        values = {n: params[n].detach().clone() for n in names}
        if overlap:
            pending = (done + overlap, names, values)
        else:
            land(names, values)
    if pending is not None:  # synchronize(): the exchange in flight lands
        land(pending[1], pending[2])
    return global_model, local


def test_fragments_split_the_model_in_order_by_size():
    from psworker.diloco import split_fragments

    model = make_model(0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert split_fragments(sizes, FRAGMENTS) == FRAGMENT_NAMES
    assert split_fragments(sizes, 1) == [list(sizes)]
    assert [len(p) for p in split_fragments(sizes, 6)] == [1] * 6


def test_streaming_fragments_with_overlap_match_streaming_diloco_written_out_in_torch(shards):
    """4 workers, 2 shards: 2 fragments, each exchange under one inner step, merged half
    and half; the shards' weights and every worker's match the torch reference."""
    expected_global, expected_local = streaming_reference()
    assert max_difference(expected_global, make_model(0)) > 1e-2  # it trained
    models, finals = trained_on_shards(
        [s.address for s in shards(2)],
        STREAM_H,
        fragments=FRAGMENTS,
        overlap_steps=OVERLAP,
        mix=MIX,
    )
    for name, value in expected_global.named_parameters():
        assert abs(finals[0][name] - value.detach().numpy()).max() <= TOLERANCE, name
    for w, model in enumerate(models):
        assert max_difference(model, expected_local[w]) <= TOLERANCE, f"worker {w}"


@pytest.mark.parametrize(
    "broken",
    [StreamBreakage(together=True), StreamBreakage(no_overlap=True), StreamBreakage(no_mix=True)],
    ids=lambda b: next(k for k, v in vars(b).items() if v),
)
def test_a_streaming_reference_broken_on_purpose_is_told_apart(broken):
    right_global, right_local = streaming_reference()
    wrong_global, wrong_local = streaming_reference(broken)
    assert (
        max(
            max_difference(right_global, wrong_global),
            max_difference(right_local[0], wrong_local[0]),
        )
        > 100 * TOLERANCE
    )
