"""Shard and consistency rules as plain Python: one contract for every mode, then each rule."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import (
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    ShapeMismatchError,
    TooLargeError,
    UnknownVariableError,
    WaitTimeoutError,
)

VALUES = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}


def job(mode: str, workers: int = 1, staleness: int = 0, **overrides) -> Job:
    fields = dict(
        mode=mode,
        staleness=staleness,
        num_workers=workers,
        optimizer=SGD(lr=1.0),
        variables=(VarSpec("w", (2, 3), "float32"), VarSpec("b", (3,), "float32")),
        model_digest="m1",
    )
    fields.update(overrides)
    return Job(**fields)  # type: ignore[arg-type]


def ready_shard(mode: str, workers: int = 1, staleness: int = 0) -> Shard:
    shard = Shard(Limits(max_wait_s=5))
    assert shard.init(0, job(mode, workers, staleness), VALUES) is True
    return shard


def ones() -> dict[str, np.ndarray]:
    return {k: np.ones_like(v) for k, v in VALUES.items()}


MODES = [("sync", 0), ("async", 0), ("ssp", 1)]


@pytest.mark.parametrize(("mode", "s"), MODES)
class TestContract:
    """What every consistency rule must satisfy."""

    def test_single_worker_push_then_pull_applies_once(self, mode, s):
        shard = ready_shard(mode, staleness=s)
        assert shard.push(0, 0, ones()).applied
        weights, clock = shard.pull(0, 1, timeout=1)
        np.testing.assert_array_equal(weights["w"], VALUES["w"] - 1)
        assert clock == 1

    def test_duplicate_push_is_acknowledged_not_applied(self, mode, s):
        shard = ready_shard(mode, staleness=s)
        shard.push(0, 0, ones())
        result = shard.push(0, 0, ones())
        assert (result.applied, result.reason) == (False, "duplicate")
        np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"] - 1)
        assert shard.status().pushes_duplicate == 1

    def test_rejected_push_changes_nothing(self, mode, s):
        shard = ready_shard(mode, staleness=s)
        bad = {"b": np.ones(3, np.float32), "w": np.ones((3, 2), np.float32)}
        with pytest.raises(ShapeMismatchError, match=r"'w' has shape \(2, 3\)"):
            shard.push(0, 0, bad)
        with pytest.raises(UnknownVariableError, match="'zz'"):
            shard.push(0, 0, {"zz": np.ones(1, np.float32)})
        with pytest.raises(InvalidRequestError, match="negative step"):
            shard.push(0, -1, ones())
        snap = shard.snapshot()
        assert all(np.array_equal(snap[k], VALUES[k]) for k in VALUES)
        assert shard.status().pushes_applied == 0

    def test_values_are_never_overwritten_by_a_later_init(self, mode, s):
        shard = ready_shard(mode, staleness=s)
        shard.push(0, 0, ones())
        assert shard.init(0, job(mode, staleness=s), VALUES) is False
        np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"] - 1)

    def test_job_mismatch_is_rejected_and_names_the_difference(self, mode, s):
        shard = ready_shard(mode, staleness=s)
        with pytest.raises(ModelMismatchError, match="model_digest"):
            shard.init(0, job(mode, staleness=s, model_digest="other"), None)
        other_mode = "async" if mode != "async" else "sync"
        with pytest.raises(ModelMismatchError, match=f"worker sent '{other_mode}'"):
            shard.init(0, job(other_mode), None)

    def test_pull_waits_for_initial_values_with_a_deadline(self, mode, s):
        shard = Shard(Limits(max_wait_s=5))
        with pytest.raises(NotInitializedError):
            shard.pull(0, 0)
        shard.init(1, job(mode, workers=2, staleness=s), None)
        with pytest.raises(WaitTimeoutError, match="worker 0"):
            shard.pull(1, 0, timeout=0.2)
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(shard.pull(1, 0, timeout=5)[0]))
        t.start()
        shard.init(0, job(mode, workers=2, staleness=s), VALUES)
        t.join(5)
        np.testing.assert_array_equal(got["w"], VALUES["w"])


def test_sync_averages_every_worker_then_releases_the_next_step():
    shard = ready_shard("sync", workers=2)
    shard.push(0, 0, ones())
    with pytest.raises(WaitTimeoutError, match=r"pushed: \[0\], still waiting for workers \[1\]"):
        shard.pull(0, 1, timeout=0.2)
    np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"])  # nothing applied yet
    shard.push(1, 0, {k: 3 * v for k, v in ones().items()})
    weights, clock = shard.pull(0, 1, timeout=1)
    np.testing.assert_array_equal(weights["w"], VALUES["w"] - 2)  # mean of 1 and 3
    assert clock == 1


def test_sync_push_for_a_later_step_waits_for_the_round():
    shard = ready_shard("sync", workers=2)
    shard.push(0, 0, ones())
    with pytest.raises(WaitTimeoutError, match="sync barrier"):
        shard.push(0, 1, ones(), timeout=0.2)
    assert shard.status().pushes_applied == 1


def test_ssp_gate_allows_exactly_s_steps_of_lead():
    shard = ready_shard("ssp", workers=2, staleness=1)
    shard.push(0, 0, ones())
    shard.pull(0, 1, timeout=0.5)  # finished 1, slowest finished 0: lead 1 allowed
    shard.push(0, 1, ones())
    with pytest.raises(WaitTimeoutError, match=r"behind .*\{1: 0\}"):
        shard.pull(0, 2, timeout=0.2)  # lead 2 > s
    shard.push(1, 0, ones())
    shard.pull(0, 2, timeout=0.5)
    # Pushes apply on arrival in ssp: three updates, no averaging.
    np.testing.assert_array_equal(shard.snapshot()["w"], VALUES["w"] - 3)


def test_async_applies_on_arrival_and_never_waits():
    shard = ready_shard("async", workers=3)
    for step in range(4):
        shard.push(0, step, ones())
    weights, clock = shard.pull(0, 4, timeout=0.1)
    assert clock == 4
    np.testing.assert_array_equal(weights["w"], VALUES["w"] - 4)


def test_limits_and_worker_ids_are_checked():
    shard = Shard(Limits(max_workers=4, max_variables=1))
    with pytest.raises(TooLargeError, match="limit of 4"):
        shard.register_worker(0, 5)
    with pytest.raises(InvalidRequestError, match="worker_id 3"):
        shard.register_worker(3, 2)
    with pytest.raises(TooLargeError, match="2 variables"):
        shard.init(0, job("async"), VALUES)
    shard = ready_shard("async", workers=2)
    with pytest.raises(ModelMismatchError, match="num_workers 3"):
        shard.register_worker(0, 3)
    with pytest.raises(InvalidRequestError, match=r"workers 0\.\.1"):
        shard.push(2, 0, ones())


def test_initial_values_are_validated_before_anything_is_installed():
    shard = Shard()
    with pytest.raises(InvalidRequestError, match="lack variable 'b'"):
        shard.init(0, job("async"), {"w": VALUES["w"]})
    with pytest.raises(InvalidRequestError, match="non-finite"):
        shard.init(0, job("async"), {"w": np.full((2, 3), np.nan, np.float32), "b": VALUES["b"]})
    assert shard.status().job is None and not shard.status().initialized


def test_the_daemon_caps_malloc_arenas_unless_the_operator_did(monkeypatch) -> None:
    from psserver.main import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert not limit_malloc_arenas()  # the operator's setting stands
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    import platform

    assert limit_malloc_arenas() == (platform.libc_ver()[0] == "glibc")


def test_calls_made_for_an_earlier_incarnation_are_refused_and_change_nothing() -> None:
    from pswire.errors import ShardRestartedError

    shard = ready_shard("async")
    grad = ones()
    with pytest.raises(ShardRestartedError, match=r"incarnation 0ld.*restarted") as info:
        shard.push(0, 0, grad, incarnation="0ld")
    assert info.value.status == "ABORTED"
    with pytest.raises(ShardRestartedError):
        shard.pull(0, 0, incarnation="0ld")
    assert np.array_equal(shard.snapshot()["w"], VALUES["w"])
    assert shard.status().pushes_applied == 0
    assert shard.push(0, 0, grad, incarnation=shard.incarnation).applied
    assert shard.push(0, 1, grad).applied  # no incarnation: no check (older clients, tools)


def test_sync_sums_into_a_pushed_array_only_when_the_push_hands_it_over() -> None:
    rng = np.random.default_rng(3)
    pushes = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in VALUES.items()}]
    pushes.append({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in VALUES.items()})
    before = [{k: g.copy() for k, g in p.items()} for p in pushes]
    results = []
    for take in (False, True):
        shard = ready_shard("sync", workers=2)
        grads = [{k: g.copy() for k, g in p.items()} for p in pushes]
        for worker in (1, 0):  # arrival order differs from the summing order
            assert shard.push(worker, 0, grads[worker], take=take).applied
        results.append(shard.pull(0, 1, timeout=1)[0])
        handed_over = any(not np.array_equal(g, before[0][k]) for k, g in grads[0].items())
        assert handed_over == take, "the first worker's array is the sum only when taken"
        for k, g in grads[1].items():  # never the accumulator: left as pushed
            np.testing.assert_array_equal(g, before[1][k])
    for k in VALUES:
        assert results[0][k].tobytes() == results[1][k].tobytes()  # the same sums, bit for bit
