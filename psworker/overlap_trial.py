"""``DistributedOptimizer(..., overlap="auto")``: overlap only where it pays, measured.

Overlap hides communication behind backward and the next forward; where communication is
already cheap (loopback, a fast link) and the processes share too few cores, its threads cost
more than they hide (bench/NOTES.md entry 44: 0.80-0.92x the serial step over loopback on two
cores, 1.50x at 1 Gbit/s in sync). ``OverlapTrial`` times ``SKIPPED + STEPS`` serial steps (the
first ``SKIPPED`` not counted: start-up), then ``STEPS + 1`` overlapped ones (the first not
counted: its reply lands under the next forward), and keeps overlap only when its steps took at
least ``MARGIN`` less time than the serial ones (a near tie keeps the serial step: fewer
threads and buffers, and workers timing the same rounds choose alike); otherwise the overlap
lands what is in flight and the serial step goes on for good. Either way the math is the same
(bit-identical in ``sync`` and ``allreduce``); only the time a step takes differs. In the
parameter-server modes the choice is each worker's: in ``sync`` every worker times the same
lockstep rounds, so they choose alike unless it is close; in ``async`` each times its own
steps. In ``allreduce`` every rank must run the same collectives, so the ranks sum their times
over the ring (``Overlap.agree``) and make the same choice at the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from psworker.overlap_watch import Overlap

__all__ = ["MARGIN", "TRIAL_STEPS", "OverlapTrial"]

log = logging.getLogger(__name__)

SKIPPED = 2  # serial steps not timed: the first steps' allocations and warm caches
STEPS = 4  # steps timed each way
MARGIN = 0.05  # overlap is kept only if its steps take at most 95% of the serial ones' time
# ``step()`` calls until the choice: the serial ones, then the overlapped ones.
TRIAL_STEPS = SKIPPED + STEPS + 1 + STEPS + 1


class OverlapTrial:
    """Times serial steps, then overlapped ones, and keeps the faster (see the module).

    ``ended(overlapped)`` is told each ``step()``'s end, on the training thread.
    """

    def __init__(self, overlap: Overlap, clock: Callable[[], float] = time.perf_counter):
        self._overlap = overlap
        self._clock = clock
        self._serial: list[float] = []  # ends of serial steps
        self._overlapped: list[float] = []  # ends of overlapped steps
        self.serial_s: float | None = None  # a serial step's mean time (once timed)
        self.overlapped_s: float | None = None  # an overlapped step's mean time (once timed)
        self.chosen: bool | None = None  # True: overlap kept; False: serial; None: timing
        overlap.hold(True)

    def ended(self, overlapped: bool) -> None:
        """A ``step()`` returned; ``overlapped``: whether the overlap ended it."""
        if self.chosen is not None:
            return
        now = self._clock()
        if not overlapped:
            if self.serial_s is not None:
                return  # released, not armed yet (no backward hook fired): judged next step
            self._serial.append(now)
            if len(self._serial) == SKIPPED + STEPS + 1:
                self.serial_s = (self._serial[-1] - self._serial[SKIPPED]) / STEPS
                self._overlap.hold(False)  # arms after this step, if the script allows
            return
        self._overlapped.append(now)
        if len(self._overlapped) == STEPS + 1:
            self.overlapped_s = (self._overlapped[-1] - self._overlapped[0]) / STEPS
            assert self.serial_s is not None
            serial, overlapped = self._overlap.agree(np.array([self.serial_s, self.overlapped_s]))
            self.chosen = bool(overlapped < (1 - MARGIN) * serial)
            log.info(
                "overlap='auto': a step took %.3f s overlapped and %.3f s serial; %s",
                self.overlapped_s,
                self.serial_s,
                "keeping overlap" if self.chosen else "the serial step from now on",
            )
            if not self.chosen:
                self._overlap.disarm()
