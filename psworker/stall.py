"""Stall warnings: while a step waits on the shards, say every N seconds which step waits, on
which workers, and how long they have been silent (as Horovod's stall inspector does).

A waiting call asks nothing new of the shards: a background thread reads their ``Status``
(each live worker's steps finished and its silence) every ``every_s`` seconds while a wait
lasts, and logs a WARNING naming the workers that have not yet finished the steps the wait
needs. ``every_s <= 0`` turns the warnings off.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pswire.proto import ps_pb2

if TYPE_CHECKING:
    from psworker.link import ShardLink

log = logging.getLogger(__name__)
# The default period: far inside the 120 s call timeout and the shards' 30 s heartbeat
# timeout, so a user hears of a missing worker long before anything fails.
DEFAULT_STALL_WARNING_S = 10.0
# The longest a Status read for a warning may take (a shard that does not answer is named).
STATUS_TIMEOUT_S = 5.0

Probe = Callable[[float], Sequence[ps_pb2.StatusResponse | None]]


@dataclass
class _Wait:
    what: str  # e.g. "step 3" or "initial values"
    need: int  # every live worker must have finished this many steps (-1: worker 0's init)
    started: float
    reports: int = 0


def describe_stall(statuses: Sequence[ps_pb2.StatusResponse | None], need: int, worker: int) -> str:
    """Who the wait is for, from the shards' statuses: each live worker other than ``worker``
    that has finished fewer than ``need`` steps, with its steps and silence (the longest any
    shard reports); ``need < 0``: worker 0's initial values."""
    answered = [s for s in statuses if s is not None]
    silent_shards = [i for i, s in enumerate(statuses) if s is None]
    parts: list[str] = []
    if need < 0:
        if not answered or not all(s.initialized for s in answered):
            parts.append("worker 0 to initialise the variables")
    else:
        missing: dict[int, tuple[int, float]] = {}
        for st in answered:
            clocks = {w.worker_id: (int(w.clock), w.seconds_since_heartbeat) for w in st.workers}
            for w in st.live_workers:
                clock, silent = clocks.get(w, (0, -1.0))
                if w == worker or clock >= need:
                    continue
                old = missing.get(w, (clock, silent))
                missing[w] = (min(old[0], clock), max(old[1], silent))
        for w in sorted(missing):
            clock, silent = missing[w]
            heard = f"silent {silent:.0f}s" if silent >= 0 else "never heard from"
            parts.append(f"worker {w} ({heard}, {clock} steps finished)")
        if not missing and answered:
            pending = sorted({w for s in answered for w in s.pending_workers})
            least = max(s.job.min_workers for s in answered)
            live = min(len(s.live_workers) for s in answered)
            if pending:
                parts.append(f"workers {pending} joining")
            elif live < least:
                parts.append(f"members: the elastic job needs {least} and has {live}")
            else:
                parts.append("no worker (every live worker has finished; a shard is slow)")
    if silent_shards:
        parts.append(f"shards {silent_shards}, whose status did not answer")
    return ", ".join(parts)


def shard_statuses(
    links: Sequence[ShardLink], timeout: float
) -> list[ps_pb2.StatusResponse | None]:
    """Each shard's status over the client's own channels (None: no answer in ``timeout``)."""
    found: list[ps_pb2.StatusResponse | None] = []
    for link in links:
        try:
            found.append(link.stub.Status(ps_pb2.StatusRequest(), timeout=timeout))
        except grpc.RpcError:
            found.append(None)
    return found


class StallWatch:
    """Warns every ``every_s`` seconds while a wait of this worker lasts; one wait at a time
    (a worker's steps are sequential). ``probe(timeout)`` reads every shard's status (None
    for a shard that did not answer); ``mode`` and ``staleness`` say what a read waits for."""

    def __init__(
        self, every_s: float, worker: int, probe: Probe, mode: str = "sync", staleness: int = 0
    ) -> None:
        self.every_s = every_s
        self.worker = worker
        self.mode = mode
        self.staleness = staleness
        self._probe = probe
        self._cond = threading.Condition()
        self._wait: _Wait | None = None
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for a wait to start (no deadline)
        self._closed = False

    def reading(self, what: str, read_step: int) -> contextlib.AbstractContextManager[None]:
        """Watches a read of step ``read_step`` (a pull, or a push_pull's pull): in sync every
        live worker must have finished ``read_step`` steps, in ssp that less the staleness;
        async reads never wait."""
        need = None if self.mode == "async" else read_step - self.staleness
        return self.waiting(what, need)

    @contextlib.contextmanager
    def waiting(self, what: str, need: int | None) -> Iterator[None]:
        """Watches the block as one wait for ``what``, which needs every live worker to have
        finished ``need`` steps (-1: worker 0's initial values; None: a call that never
        waits for others, not watched)."""
        if self.every_s <= 0 or self._closed or need is None:
            yield
            return
        with self._cond:
            self._wait = _Wait(what, need, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"ps-stall-{self.worker}", daemon=True
                )
                self._thread.start()
            elif self._idle:
                # Only a thread with no wait to time needs waking: one timing an earlier wait
                # wakes at that one's deadline and times this one from there. So a run of
                # quick steps costs no thread wake-up per step.
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._wait = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                wait = self._wait
                if wait is None:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                    continue
                delay = wait.started + self.every_s * (wait.reports + 1) - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                wait.reports += 1
                self._cond.release()
                try:
                    self._report(wait)
                finally:
                    self._cond.acquire()

    def _report(self, wait: _Wait) -> None:
        try:
            statuses = self._probe(min(STATUS_TIMEOUT_S, self.every_s))
        except Exception as exc:  # a warning must never break the step it watches
            log.debug("stall probe failed: %s", exc)
            return
        with self._cond:
            if self._wait is not wait:
                return  # the wait ended while the shards were asked
        hint = (
            f" (stall warnings every {self.every_s:g}s: connect(stall_warning_s=...) or "
            "$PS_STALL_WARNING; 0 turns them off)"
            if wait.reports == 1
            else ""
        )
        log.warning(
            "worker %d: %s has waited %.0fs, for %s%s",
            self.worker,
            wait.what,
            time.monotonic() - wait.started,
            describe_stall(statuses, wait.need, self.worker),
            hint,
        )
