"""A worker's own figures (the script's loss, this process's memory, step time and bytes) for
the live dashboard: one JSON line per report, appended to ``$PS_REPORT_DIR/worker<id>.jsonl``.

The folder is the one ``psctl dashboard --reports DIR`` reads; with ``$PS_REPORT_DIR`` unset
a report costs nothing and goes nowhere. A file per worker (opened once, each line flushed)
needs no server and no change to the shards' protocol, and survives the dashboard starting
after the job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import IO, Any

from pswire.errors import ConfigError, PSError

REPORT_DIR_ENV = "PS_REPORT_DIR"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; 0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class Reporter:
    """Appends one worker's reports to ``folder/worker<id>.jsonl`` (thread-safe)."""

    def __init__(self, folder: str | os.PathLike[str], worker_id: int) -> None:
        self.path = Path(folder) / f"worker{worker_id}.jsonl"
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._file: IO[str] | None = None

    def write(self, step: int, values: dict[str, Any]) -> None:
        """One line: the time, worker, ``step``, this process's RSS and ``values``.

        Raises:
            ConfigError: a value that is not a real number (named), or a name that clashes
                with the line's own fields.
            OSError: the folder cannot be written.
        """
        line: dict[str, float | int | None] = {
            "t": time.time(),
            "worker": self.worker_id,
            "step": int(step),
            "rss": rss_bytes(),
        }
        for name, value in values.items():
            if name in line:
                raise ConfigError(f"report value {name!r} clashes with a field of the report")
            line[name] = None if value is None else _number(name, value)
        text = json.dumps(line, allow_nan=False) + "\n"
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _number(name: str, value: Any) -> float | int | None:
    """``value`` as a float (a 0-d tensor or numpy scalar too; a Python int stays one, as a
    count of steps or bytes); None for NaN/inf, which JSON cannot carry and the dashboard
    shows as a gap."""
    if type(value) is int:
        return value
    if hasattr(value, "detach"):  # a torch tensor, e.g. the loss itself: no autograd warning
        value = value.detach()
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"report value {name!r} must be a number, got {type(value).__name__}"
        ) from None
    return number if math.isfinite(number) else None


_reporters: dict[tuple[str, int], Reporter] = {}
_reporters_lock = threading.Lock()


def reporter_for(worker_id: int, folder: str | None = None) -> Reporter | None:
    """The reporter of ``worker_id`` into ``folder`` (default ``$PS_REPORT_DIR``); None when
    no folder is set."""
    folder = folder if folder is not None else os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return None
    key = (str(Path(folder).resolve()), worker_id)
    with _reporters_lock:
        found = _reporters.get(key)
        if found is None:
            found = _reporters[key] = Reporter(folder, worker_id)
        return found


def report(client: Any, **values: Any) -> bool:
    """Reports this worker's figures at its current step, e.g. ``report(client, loss=l)``.

    ``client`` is the worker's client (its ``worker_id`` and ``step`` label the line); values
    are numbers (floats, ints, 0-d tensors). Written to ``$PS_REPORT_DIR`` for ``psctl
    dashboard``; returns False (and does nothing) when that is unset.

    Raises:
        ConfigError: a value that is not a number.
        OSError: the report folder cannot be written.
    """
    found = reporter_for(int(client.worker_id))
    if found is None:
        return False
    found.write(int(client.step), values)
    return True


def _write_held(reporter: Reporter, held: list[Any], lock: threading.Lock) -> None:
    """Writes the line a ``StepLog`` held back (``held[0]``), if any: from ``flush()``, when
    the log is collected, and at the process's exit (a process killed loses it)."""
    with lock:
        line, held[0] = held[0], None
        if line is not None:
            with contextlib.suppress(OSError):  # the folder went away: nowhere to write it
                reporter.write(*line)


class StepLog:
    """What ``DistributedOptimizer`` records per step: to a TensorBoard ``SummaryWriter`` (any
    object with ``add_scalar(tag, value, step)``) when given one, and to the report folder
    when ``$PS_REPORT_DIR`` is set.

    Per step: its wall time (``psworker/step_time_s``), the bytes pushed and pulled
    (``psworker/bytes_sent``, ``psworker/bytes_received``) and this worker's staleness
    (``psworker/staleness_steps``: steps behind the most advanced worker, as the shards'
    ``psserver_worker_staleness_steps``; read from the shards' Status at most every
    ``staleness_every_s`` seconds, 0 in ``local`` and ``allreduce``); and whatever the script
    reports (``report(loss=...)``) under its own name. In DiLoCo ``DiLoCoOptimizer`` records
    its outer steps only: the step is the outer step, its time from the outer step's start to
    its landing (its push and pull; with ``overlap_steps`` also the inner steps that ran while
    it was in flight).

    A report line (at most every ``report_every_s``) carries the client's ``step`` (the steps
    this worker has finished, as ``report()``'s lines: inner steps in DiLoCo), the
    ``pushed_step`` of the last push (the shards' clock: the outer step in DiLoCo), its time,
    its bytes (``bytes_sent``, ``bytes_received``) and the totals of every step recorded so
    far (``bytes_sent_total``, ``bytes_received_total``: also those of steps whose line the
    rate limit left out).
    """

    def __init__(
        self,
        client: Any,
        writer: Any = None,
        staleness_every_s: float = 2.0,
        report_every_s: float = 1.0,
    ) -> None:
        self.client = client
        self.writer = writer
        self.reporter = reporter_for(int(client.worker_id))
        self._staleness_every_s = staleness_every_s
        self._report_every_s = report_every_s
        self._staleness = 0
        self._staleness_read = -math.inf
        self._reported = -math.inf
        self.bytes_sent_total = 0
        self.bytes_received_total = 0
        self._lock = threading.Lock()
        self._held: list[Any] = [None]  # the line the rate limit held back: (step, figures)
        if self.reporter is not None:
            weakref.finalize(self, _write_held, self.reporter, self._held, self._lock)

    @property
    def active(self) -> bool:
        """Whether anything is recorded (a writer, or a report folder)."""
        return self.writer is not None or self.reporter is not None

    def step(self, step: int, seconds: float, sent: int, received: int) -> None:
        """Records one finished step (``step``: the step it pushed)."""
        now = time.monotonic()
        self.bytes_sent_total += int(sent)
        self.bytes_received_total += int(received)
        if self.writer is not None:
            self.writer.add_scalar("psworker/step_time_s", seconds, step)
            self.writer.add_scalar("psworker/bytes_sent", sent, step)
            self.writer.add_scalar("psworker/bytes_received", received, step)
            self.writer.add_scalar("psworker/staleness_steps", self._read_staleness(now), step)
        if self.reporter is None:
            return
        figures = {
            "pushed_step": step,
            "step_time_s": seconds,
            "bytes_sent": sent,
            "bytes_received": received,
            "bytes_sent_total": self.bytes_sent_total,
            "bytes_received_total": self.bytes_received_total,
        }
        with self._lock:
            if now - self._reported >= self._report_every_s:
                self._reported = now
                self._held[0] = None
                self.reporter.write(int(self.client.step), figures)
            else:  # replaced by the next step's, written by flush() at the latest
                self._held[0] = (int(self.client.step), figures)

    def flush(self) -> None:
        """Writes the last step's line if the once-a-second limit held it back, so the
        report folder ends with the worker's final step and totals (also done when the log
        is collected and at exit)."""
        if self.reporter is not None:
            _write_held(self.reporter, self._held, self._lock)

    def report(self, values: dict[str, Any]) -> None:
        """The script's own figures at the client's current step, e.g. ``loss``.

        Raises:
            ConfigError: a value that is not a number.
        """
        step = int(self.client.step)
        numbers = {name: _number(name, value) for name, value in values.items()}
        if self.writer is not None:
            for name, value in numbers.items():
                if value is not None:
                    self.writer.add_scalar(name, value, step)
        if self.reporter is not None:
            self.reporter.write(step, numbers)

    def _read_staleness(self, now: float) -> int:
        if now - self._staleness_read < self._staleness_every_s:
            return self._staleness
        self._staleness_read = now
        try:
            statuses = self.client.status()
        except PSError:  # a shard that does not answer fails the step itself, not a chart
            return self._staleness
        me = int(self.client.worker_id)
        behind = 0
        for status in statuses:
            clocks = {int(w.worker_id): int(w.clock) for w in status.workers}
            if me in clocks:
                behind = max(behind, max(clocks.values()) - clocks[me])
        self._staleness = behind
        return behind
