"""overlap="auto" (psworker/overlap_trial.py): serial steps timed, then overlapped ones, and
the faster kept; the overlap is held unarmed until the serial steps are timed."""

from __future__ import annotations

import numpy as np
import pytest

from psworker.overlap_trial import MARGIN, SKIPPED, STEPS, TRIAL_STEPS, OverlapTrial


class FakeOverlap:
    def __init__(self) -> None:
        self.held: list[bool] = []
        self.disarmed = 0
        self.others = np.zeros(2)

    def hold(self, held: bool) -> None:
        self.held.append(held)

    def disarm(self) -> None:
        self.disarmed += 1

    def agree(self, times: np.ndarray) -> np.ndarray:
        return times + self.others  # every other rank's times summed in (the ring)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(serial_s: float, overlapped_s: float, slow_first: float = 50.0):
    """Steps as DistributedOptimizer tells them: serial until released (and armed), then
    overlapped; the first serial steps (start-up) take ``slow_first``."""
    overlap, clock = FakeOverlap(), Clock()
    trial = OverlapTrial(overlap, clock)
    assert overlap.held == [True]
    serial = 0
    while trial.serial_s is None:
        clock.now += slow_first if serial < SKIPPED else serial_s
        trial.ended(overlapped=False)
        serial += 1
    assert serial == SKIPPED + STEPS + 1 and overlap.held == [True, False]
    overlapped = 0
    while trial.chosen is None:
        clock.now += overlapped_s
        trial.ended(overlapped=True)
        overlapped += 1
        assert overlapped <= STEPS + 1
    assert overlapped == STEPS + 1 and serial + overlapped == TRIAL_STEPS
    return trial, overlap


@pytest.mark.parametrize("overlapped_s", [0.6, 0.94])
def test_overlap_kept_when_its_steps_are_faster_by_the_margin(overlapped_s):
    trial, overlap = run(serial_s=1.0, overlapped_s=overlapped_s)
    assert trial.chosen is True and overlap.disarmed == 0
    assert trial.serial_s == pytest.approx(1.0)
    assert trial.overlapped_s == pytest.approx(overlapped_s)


@pytest.mark.parametrize("overlapped_s", [1.2, 1.0, 0.97])
def test_the_serial_step_kept_when_overlap_is_not_faster_by_the_margin(overlapped_s):
    assert overlapped_s > 1 - MARGIN
    trial, overlap = run(serial_s=1.0, overlapped_s=overlapped_s)
    assert trial.chosen is False and overlap.disarmed == 1


def test_start_up_steps_do_not_count():
    # The first serial steps are slow (start-up): counted, they would make serial look slower.
    trial, _ = run(serial_s=1.0, overlapped_s=1.1, slow_first=30.0)
    assert trial.serial_s == pytest.approx(1.0) and trial.chosen is False


@pytest.mark.parametrize(("others", "kept"), [((1.0, 1.5), False), ((1.0, 0.5), True)])
def test_the_agreed_times_decide(others, kept):
    # This rank alone: 1.0 s serial, 0.8 s overlapped. The ring's sum over the ranks decides.
    overlap, clock = FakeOverlap(), Clock()
    overlap.others = np.array(others)
    trial = OverlapTrial(overlap, clock)
    for _ in range(SKIPPED + STEPS + 1):
        clock.now += 1.0
        trial.ended(overlapped=False)
    for _ in range(STEPS + 1):
        clock.now += 0.8
        trial.ended(overlapped=True)
    assert trial.chosen is kept and overlap.disarmed == (0 if kept else 1)


def test_a_decided_trial_and_a_serial_step_before_arming_change_nothing():
    overlap, clock = FakeOverlap(), Clock()
    trial = OverlapTrial(overlap, clock)
    for _ in range(SKIPPED + STEPS + 1):
        clock.now += 1.0
        trial.ended(overlapped=False)
    clock.now += 40.0  # released, but no backward hook fired: still serial, not timed
    trial.ended(overlapped=False)
    for _ in range(STEPS + 1):
        clock.now += 0.5
        trial.ended(overlapped=True)
    assert trial.chosen is True and trial.overlapped_s == pytest.approx(0.5)
    clock.now += 99.0
    trial.ended(overlapped=True)
    trial.ended(overlapped=False)
    assert trial.chosen is True and overlap.disarmed == 0 and overlap.held == [True, False]
