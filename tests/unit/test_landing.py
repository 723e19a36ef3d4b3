"""psworker/landing.py with replies played by hand: a module waits only for its own tensors of a
reply that tells each as it lands, an op reading a tensor outside its module waits for it too,
a failed reply raises, and each changed parameter is marked changed once."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pswire.errors import UnavailableError  # noqa: E402
from psworker.landing import Landing  # noqa: E402
from psworker.placement import VarInfo, plan  # noqa: E402

WAIT_S = 10.0


class Two(torch.nn.Module):
    """Two layers, and a third whose weight only the parent reads (functionally)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.tied = torch.nn.Linear(4, 4, bias=False)  # never called: its weight is read below
        self.ran: list[str] = []
        self.a.register_forward_hook(lambda *_: self.ran.append("a"))
        self.b.register_forward_hook(lambda *_: self.ran.append("b"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(self.b(self.a(x)), self.tied.weight)
        self.ran.append("functional")
        return out


def landing(model: torch.nn.Module, told: list[bool]) -> tuple[Landing, dict[str, Any]]:
    tensors = dict(model.named_parameters())
    shard_map = plan([VarInfo(n, tuple(t.shape), "float32") for n, t in tensors.items()], 1)
    return Landing(model, tensors, shard_map, WAIT_S, told.append), tensors


def forward_in_thread(model: torch.nn.Module) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(model(torch.ones(1, 4)))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_until(what: str, condition: Any) -> None:
    done = threading.Event()
    for _ in range(1000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"never: {what}")


def test_a_module_runs_once_its_own_tensors_landed_while_the_rest_still_arrives() -> None:
    model, told = Two(), []
    land, tensors = landing(model, told)
    call: Future[bool | None] = Future()
    call.set_running_or_notify_cancel()
    versions = {n: t._version for n, t in tensors.items()}
    land.add(0, call, list(tensors), keyed=True)
    thread, result = forward_in_thread(model)
    land.placed("a.weight")
    land.placed("a.bias")
    wait_until("layer a ran", lambda: model.ran == ["a"])
    thread.join(0.2)
    assert model.ran == ["a"] and thread.is_alive()  # b waits for its own tensors
    land.placed("b.weight")
    land.placed("b.bias")
    wait_until("layer b ran", lambda: model.ran == ["a", "b"])
    thread.join(0.2)
    assert thread.is_alive()  # the parent's functional read of tied.weight waits for it
    land.placed("tied.weight")
    thread.join(WAIT_S)
    assert model.ran == ["a", "b", "functional"] and isinstance(result[0], torch.Tensor)
    # Each changed parameter bumped once, before its first read; none twice by the end.
    call.set_result(False)
    land.wait()
    assert {n: t._version - versions[n] for n, t in tensors.items()} == dict.fromkeys(tensors, 1)
    assert told == [False] and not land.pending


def test_a_reply_that_fails_raises_in_the_forward_waiting_for_it() -> None:
    model, told = Two(), []
    land, tensors = landing(model, told)
    call: Future[bool | None] = Future()
    call.set_running_or_notify_cancel()
    land.add(0, call, list(tensors), keyed=True)
    thread, result = forward_in_thread(model)
    call.set_exception(UnavailableError("shard 0 went away"))
    thread.join(WAIT_S)
    assert isinstance(result[0], UnavailableError)
    assert not land.pending


def test_a_reply_sent_whole_lands_whole_and_says_a_step_was_skipped() -> None:
    model, told = Two(), []
    land, tensors = landing(model, told)
    call: Future[bool | None] = Future()
    call.set_running_or_notify_cancel()
    land.add(0, call, list(tensors), keyed=False)
    land.placed("a.weight")  # not keyed: pieces are not enough
    thread, result = forward_in_thread(model)
    thread.join(0.2)
    assert thread.is_alive() and model.ran == []
    call.set_result(True)
    thread.join(WAIT_S)
    assert isinstance(result[0], torch.Tensor) and told == [True]
