"""``DistributedOptimizer(writer=SummaryWriter(...))``: each step's time, bytes and staleness
and the script's reported loss land in TensorBoard event files, read back with TensorBoard's
own ``EventAccumulator``; and ``$PS_REPORT_DIR`` gets the dashboard's report lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

import psworker  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

TAGS = {
    "psworker/step_time_s",
    "psworker/bytes_sent",
    "psworker/bytes_received",
    "psworker/staleness_steps",
    "loss",
}


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def step(opt: DistributedOptimizer, model: torch.nn.Module) -> None:
    opt.zero_grad()
    loss = model(torch.ones(2, 3)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.report(loss=loss)  # a 0-d tensor is a number too


def test_an_async_worker_writes_step_time_bytes_staleness_and_loss(shards, tmp_path):
    addresses = [s.address for s in shards(2)]
    models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    writers = [SummaryWriter(str(tmp_path / f"w{i}")) for i in range(2)]
    clients = [
        psworker.connect(addresses, worker_id=i, num_workers=2, mode="async") for i in range(2)
    ]
    try:
        opts = [
            DistributedOptimizer(m, c, psworker.SGD(lr=0.01), writer=w)
            for m, c, w in zip(models, clients, writers, strict=True)
        ]
        for _ in range(6):  # worker 0 runs ahead: async never waits
            step(opts[0], models[0])
        step(opts[1], models[1])
    finally:
        for c in clients:
            c.close()
        for w in writers:
            w.close()
    nbytes = sum(p.numel() * 4 for p in models[0].parameters())  # float32 gradients, weights
    first, second = read_scalars(tmp_path / "w0"), read_scalars(tmp_path / "w1")
    assert set(first) == set(second) == TAGS
    assert [s for s, _ in first["psworker/step_time_s"]] == list(range(6))
    assert all(v > 0 for _, v in first["psworker/step_time_s"])
    assert {v for _, v in first["psworker/bytes_sent"]} == {nbytes}
    assert {v for _, v in first["psworker/bytes_received"]} == {nbytes}
    assert [s for s, _ in first["loss"]] == list(range(1, 7))  # reported after each step
    assert first["psworker/staleness_steps"][0][1] == 0
    # Worker 1's one step came 6 behind worker 0's (its push made it 1 of 6).
    assert second["psworker/staleness_steps"] == [(0, 5.0)]


def test_reports_reach_the_report_folder_without_a_writer(monkeypatch, tmp_path):
    monkeypatch.setenv("PS_REPORT_DIR", str(tmp_path / "reports"))
    model = torch.nn.Linear(3, 2)
    with psworker.connect(mode="local") as client:
        opt = DistributedOptimizer(model, client, psworker.SGD(lr=0.01))
        for _ in range(2):
            step(opt, model)
    lines = [
        json.loads(line)
        for line in (tmp_path / "reports" / "worker0.jsonl").read_text().splitlines()
    ]
    losses = [line for line in lines if "loss" in line]
    assert [line["step"] for line in losses] == [1, 2]
    assert all(line["rss"] > 0 and line["worker"] == 0 for line in lines)
    assert any("step_time_s" in line for line in lines)


def test_nothing_is_recorded_without_a_writer_or_a_report_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("PS_REPORT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(3, 2)
    with psworker.connect(mode="local") as client:
        opt = DistributedOptimizer(model, client, psworker.SGD(lr=0.01))
        step(opt, model)
        with pytest.raises(ValueError, match="'loss' must be a number, got str"):
            opt._log.report({"loss": "low"})
    assert list(tmp_path.iterdir()) == []
