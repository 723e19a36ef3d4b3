"""Dynamic local steps (DyLU, asynchronous DiLoCo): the rule that scales a worker's local steps
by its pace, the pace a worker measures, and the paces a shard keeps and relays (each worker
says its own with a heartbeat and hears the fastest live worker's)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hand_clock import Clock
from hypothesis import given
from hypothesis import strategies as st

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.paces import MAX_SECONDS_PER_STEP, Paces
from psserver.records import Limits
from psserver.shard import Shard
from pswire.errors import ConfigError, InvalidRequestError
from psworker.diloco import DiLoCoSettings, PaceMeter, dynamic_local_steps


def test_a_worker_half_as_fast_takes_half_the_local_steps():
    assert dynamic_local_steps(24, own=2.0, fastest=1.0) == 12
    assert dynamic_local_steps(25, own=2.0, fastest=1.0) == 12  # 12.5 rounds to even
    assert dynamic_local_steps(25, own=1.0, fastest=1.0) == 25  # the fastest takes H
    assert dynamic_local_steps(25, own=4.0, fastest=1.0) == 6
    assert dynamic_local_steps(25, own=1000.0, fastest=1.0) == 1  # never none


def test_unknown_paces_take_every_local_step():
    assert dynamic_local_steps(25, own=0.0, fastest=1.0) == 25
    assert dynamic_local_steps(25, own=1.0, fastest=0.0) == 25


@given(
    most=st.integers(1, 1000),
    own=st.floats(0, 1e4, allow_nan=False),
    fastest=st.floats(0, 1e4, allow_nan=False),
)
def test_local_steps_stay_within_one_and_h(most, own, fastest):
    steps = dynamic_local_steps(most, own, fastest)
    assert 1 <= steps <= most
    if own > 0 and fastest > 0 and fastest >= own:
        assert steps == most  # a stale "fastest" slower than this worker never cuts its steps


def test_the_pace_is_the_median_of_the_last_three_outer_steps():
    """One slow stretch (an evaluation between outer steps) does not move the pace."""
    clock = Clock(0.0)
    meter = PaceMeter(clock)
    clock.now += 10.0
    assert meter.lap(10) == 1.0
    meter.restart()
    clock.now += 100.0  # an evaluation in this one
    assert meter.lap(10) == pytest.approx(5.5)  # the median of two: their mean
    meter.restart()
    clock.now += 10.0
    assert meter.lap(10) == 1.0
    meter.restart()
    clock.now += 20.0
    assert meter.lap(10) == 2.0  # the last three: 10, 1, 2 -> the slow one has no say


def test_dynamic_local_steps_are_an_option_of_the_asynchronous_outer_steps():
    with pytest.raises(ConfigError, match="pass outer_sync=False"):
        DiLoCoSettings(local_steps=25, dynamic_local_steps=True)
    with pytest.raises(ConfigError, match="dynamic_local_steps must be True or False, got 1"):
        DiLoCoSettings(local_steps=25, outer_sync=False, dynamic_local_steps=1)  # type: ignore[arg-type]
    dylu = DiLoCoSettings(local_steps=25, outer_sync=False, dynamic_local_steps=True)
    assert "dynamic_local_steps=True" in dylu.variant("AdamW[]")
    plain = DiLoCoSettings(local_steps=25, outer_sync=False)
    assert "dynamic" not in plain.variant("AdamW[]")  # the digest of jobs without it is as it was


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, MAX_SECONDS_PER_STEP * 2])
def test_a_pace_that_is_no_duration_is_refused_naming_it(bad):
    with pytest.raises(InvalidRequestError, match=f"seconds_per_step must be .* got {bad!r}"):
        Paces.check(3, bad)


def test_a_shard_relays_the_fastest_live_workers_pace():
    clock = Clock()
    shard = Shard(Limits(heartbeat_timeout_s=10.0, max_wait_s=5), clock=clock)
    job = Job("async", 0, 3, SGD(lr=1.0), (VarSpec("w", (2,), "float32"),), "digest")
    assert shard.init(0, job, {"w": np.zeros(2, np.float32)})
    for worker in range(3):
        shard.register_worker(worker, 3)
    assert shard.beat(0).fastest_seconds_per_step == 0.0  # nobody has said
    assert shard.beat(0, seconds_per_step=2.0).fastest_seconds_per_step == 2.0
    assert shard.beat(1, seconds_per_step=0.5).fastest_seconds_per_step == 0.5
    assert shard.beat(2, seconds_per_step=1.0).fastest_seconds_per_step == 0.5
    assert shard.beat(2).fastest_seconds_per_step == 0.5  # 0: worker 2 keeps its 1.0
    # A worker that left no longer counts: the fastest is the fastest of those training.
    shard.leave(1)
    assert shard.beat(0).fastest_seconds_per_step == 1.0
    # A refused pace changes nothing (worker 2 keeps 1.0, worker 0 its 2.0).
    with pytest.raises(InvalidRequestError, match="got nan"):
        shard.beat(2, seconds_per_step=math.nan)
    assert shard.beat(0).fastest_seconds_per_step == 1.0
    # A worker silent past the timeout is dropped, and its pace with it.
    for _ in range(3):  # worker 0 keeps beating, worker 2 is silent for 12 s
        clock.now += 4.0
        shard.beat(0)
    assert shard.expire_silent() == [2]
    assert shard.beat(0).fastest_seconds_per_step == 2.0
