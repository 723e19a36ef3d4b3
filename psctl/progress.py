"""Worker progress as machine-readable lines, and their rendering as bars or plain log lines."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from psctl.launch import PrefixedOutput

PREFIX = "PSPROGRESS "
DEFAULT_EVERY_S = 0.25
# Without a terminal: one line per tenth of the run, so a CI log shows ~10 lines per worker.
PLAIN_STEPS = 10
_FIXED_SIZE = {"ncols": 100, "nrows": 24}


@dataclass(frozen=True)
class Progress:
    """One report: ``step`` of ``total`` steps done, mean ``loss`` since the last report."""

    worker: int
    step: int
    total: int
    loss: float
    sps: float

    def to_line(self) -> str:
        fields = {
            "worker": self.worker,
            "step": self.step,
            "total": self.total,
            "loss": round(self.loss, 6),
            "sps": round(self.sps, 1),
        }
        return PREFIX + json.dumps(fields, separators=(",", ":"))


def parse(line: str) -> Progress | None:
    """The report a ``PSPROGRESS {...}`` line holds, or None for any other (or malformed) line."""
    if not line.startswith(PREFIX):
        return None
    try:
        fields = json.loads(line[len(PREFIX) :])
        return Progress(
            worker=int(fields["worker"]),
            step=int(fields["step"]),
            total=int(fields["total"]),
            loss=float(fields["loss"]),
            sps=float(fields["sps"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


class Reporter:
    """Prints a worker's progress lines: at the first and last step and every ``every_s``.

    Throttled by time, not steps, so a fast job does not flood the launcher's pipe; the loss
    reported is the mean over the steps since the previous line.
    """

    def __init__(
        self,
        worker: int,
        total: int,
        out: TextIO | None = None,
        every_s: float = DEFAULT_EVERY_S,
    ) -> None:
        self.worker, self.total, self.every_s = worker, total, every_s
        self._out = out if out is not None else sys.stdout
        self._start = time.perf_counter()
        self._last_emit = -math.inf
        self._loss_sum, self._loss_count = 0.0, 0

    def update(self, step: int, loss: float, samples: int) -> None:
        """Records step ``step`` (1-based) with its ``loss``; ``samples`` seen so far."""
        self._loss_sum += loss
        self._loss_count += 1
        now = time.perf_counter()
        if step not in (1, self.total) and now - self._last_emit < self.every_s:
            return
        elapsed = max(now - self._start, 1e-9)
        report = Progress(
            self.worker, step, self.total, self._loss_sum / self._loss_count, samples / elapsed
        )
        self._out.write(report.to_line() + "\n")
        self._out.flush()
        self._last_emit = now
        self._loss_sum, self._loss_count = 0.0, 0


class ProgressOutput(PrefixedOutput):
    """Children's output with their progress lines drawn as one tqdm bar per worker.

    Bars go to ``bar_stream`` only when it is a terminal (and tqdm is installed); otherwise a
    progress line becomes a plain prefixed line once per tenth of the run. Every other line
    passes through with its prefix, written around the bars so they stay intact.
    """

    def __init__(
        self, stream: TextIO | None = None, bar_stream: TextIO | None = None, bars: bool = True
    ) -> None:
        super().__init__(stream)
        self._bar_stream = bar_stream if bar_stream is not None else sys.stderr
        self._tqdm: Any = _tqdm() if bars and _isatty(self._bar_stream) else None
        self._bars: dict[str, Any] = {}
        self._next_plain: dict[str, int] = {}

    @property
    def bars(self) -> bool:
        """Whether progress is drawn as bars (else as plain lines)."""
        return self._tqdm is not None

    def line(self, name: str, text: str) -> None:
        report = parse(text)
        if report is None:
            super().line(name, text)
            return
        with self.lock:
            if self._tqdm is not None:
                self._draw(name, report)
            else:
                self._plain(name, report)

    def close(self) -> None:
        with self.lock:
            for bar in self._bars.values():
                bar.close()
            self._bars.clear()

    def write(self, text: str) -> None:
        if self._tqdm is None:
            super().write(text)
        else:
            # Clears the bars, writes the line, redraws them: output and bars do not interleave.
            self._tqdm.write(text, file=self._stream)
            self._stream.flush()

    def _draw(self, name: str, report: Progress) -> None:
        bar = self._bars.get(name)
        if bar is None:
            bar = self._bars[name] = self._tqdm(
                total=report.total,
                desc=name,
                position=len(self._bars),
                file=self._bar_stream,
                unit="step",
                leave=True,
                # A terminal that reports no size (e.g. `script` without a tty) gets a fixed
                # one: tqdm hides bars below a screen of 0 rows, i.e. draws nothing.
                **({"dynamic_ncols": True} if _has_size(self._bar_stream) else _FIXED_SIZE),
            )
        bar.set_postfix_str(f"loss {report.loss:.4f}, {report.sps:.0f} samples/s", refresh=False)
        bar.update(report.step - bar.n)

    def _plain(self, name: str, report: Progress) -> None:
        due = self._next_plain.get(name, 1)
        if report.step < due and report.step != report.total:
            return
        percent = 100 * report.step // max(report.total, 1)
        super().write(
            f"[{name}] step {report.step}/{report.total} ({percent}%) "
            f"loss {report.loss:.4f}, {report.sps:.0f} samples/s"
        )
        stride = max(1, math.ceil(report.total / PLAIN_STEPS))
        self._next_plain[name] = (report.step // stride + 1) * stride


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _has_size(stream: TextIO) -> bool:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


def _tqdm() -> Any:
    """tqdm's bar class, or None when tqdm (an optional dependency) is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
