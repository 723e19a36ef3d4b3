"""``psctl dashboard``'s data: samples of the shards' Status and ``/metrics`` and the workers'
reports, kept as time series for the page to plot.

A ``Sampler`` reads every source once per interval (a read never changes a shard) and keeps
the last ``history`` samples; ``series()`` turns them into what the page draws: per worker
steps/s, loss, staleness, RSS and bytes sent and received, per shard sync round wait, bytes
in and out, refused requests and RSS, the membership changes as marks on the time axis, and
a table of the workers' newest figures. In a DiLoCo job (the shards' Status names its local
steps) the shards' clocks count outer steps, and the titles and units say so.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
import urllib.request
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from psctl import status_view
from pswire.security import ClientSecurity

DEFAULT_INTERVAL_S = 1.0
DEFAULT_HISTORY = 3600  # samples kept: an hour at one a second
# What the workers' table shows and the charts do not: a report line's time and ``step`` (the
# worker's own, inner in DiLoCo; psworker/reports.py), and the steps/s between two reads.
NOT_CHARTED = ("t", "step", "steps_per_s")
RATE_WINDOW_S = 10.0  # rates (steps/s, bytes/s, ...) are means over this many seconds


@dataclass(frozen=True)
class DashboardSources:
    """Where the figures come from.

    ``shards``: gRPC addresses (Status); ``metrics``: each shard's ``/metrics`` as host:port,
    in the same order (empty: none; bytes, waits, refusals and shard RSS then stay blank);
    ``reports``: the folder of the workers' report files (``$PS_REPORT_DIR`` of the job), or
    None; ``timeout``: seconds each source has to answer.
    """

    shards: tuple[str, ...]
    metrics: tuple[str, ...] = ()
    reports: Path | None = None
    timeout: float = 5.0

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("the dashboard needs at least one shard address")
        if self.metrics and len(self.metrics) != len(self.shards):
            raise ValueError(
                f"--metrics lists {len(self.metrics)} addresses for {len(self.shards)} shards; "
                "give one per shard, in the shards' order"
            )
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")


@dataclass
class Sample:
    """Everything read at one time ``t`` (seconds since the epoch)."""

    t: float
    shards: list[dict[str, Any]]  # per shard: clock, bytes, waits, refusals, rss, or error
    workers: dict[int, dict[str, Any]]  # per worker: clock, staleness, loss, rss
    events: list[dict[str, Any]] = field(default_factory=list)  # membership changes seen


def parse_metrics(text: str) -> dict[str, float]:
    """The figures the dashboard plots from one shard's Prometheus text: cumulative bytes in
    (``push_bytes``) and out (``pull_bytes``), refused calls (any status but OK), the sync
    wait's sum and count, and the process's RSS."""
    out = {"bytes_in": 0.0, "bytes_out": 0.0, "refused": 0.0, "wait_sum": 0.0}
    out.update(wait_count=0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "psserver_push_bytes_total":
                out["bytes_in"] += s.value
            elif s.name == "psserver_pull_bytes_total":
                out["bytes_out"] += s.value
            elif s.name == "psserver_rpcs_total" and s.labels.get("code") != "OK":
                out["refused"] += s.value
            elif s.name == "psserver_barrier_wait_seconds_sum":
                out["wait_sum"] += s.value
            elif s.name == "psserver_barrier_wait_seconds_count":
                out["wait_count"] += s.value
            elif s.name == "process_resident_memory_bytes":
                out["rss"] = s.value
    return out


class ReportTail:
    """Reads the lines workers appended to their report files since the last call."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}

    def read(self) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        for path in sorted(self.folder.glob("worker*.jsonl")):
            start = self._offsets.get(path, 0)
            try:
                with path.open("rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            self._offsets[path] = start + end
            for raw in data[:end].splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("worker"), int):
                    lines.append(line)
        return lines


class Sampler:
    """Reads the sources every ``interval`` seconds in a daemon thread; ``series()`` is what
    the page gets."""

    def __init__(
        self,
        sources: DashboardSources,
        interval: float = DEFAULT_INTERVAL_S,
        history: int = DEFAULT_HISTORY,
        security: ClientSecurity | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.sources = sources
        self.interval = interval
        self._security = security or ClientSecurity.from_env()
        self._clock = clock
        self._samples: deque[Sample] = deque(maxlen=history)
        self._events: dict[tuple[str, int, int], dict[str, Any]] = {}
        self._tail = ReportTail(sources.reports) if sources.reports is not None else None
        # Each worker's newest reported figures (a line comes at most once a second, in
        # DiLoCo once an outer step): charted in every sample while the worker is live.
        self._reported: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dashboard-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.sources.timeout * 2 + self.interval)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def sample(self) -> Sample:
        """Reads every source once and keeps the result."""
        t = self._clock()
        health, statuses = status_view.gather(
            self.sources.shards, self.sources.timeout, self._security
        )
        data = status_view.to_data(self.sources.shards, statuses, health)
        shards: list[dict[str, Any]] = []
        workers: dict[int, dict[str, Any]] = {}
        events: list[dict[str, Any]] = []
        for i, shard in enumerate(data["shards"]):
            entry: dict[str, Any] = {"error": shard.get("error")}
            if not shard.get("error"):
                entry["clock"] = shard["clock"]
                entry["mode"] = shard["mode"]
                entry["diloco"] = shard["diloco"]
                entry["spread"] = shard["max_staleness"]
                unit = "outer step" if shard["diloco"] else "step"
                for change in shard["membership"]["history"]:
                    key = (change["kind"], change["worker_id"], change["step"])
                    if key not in self._events:
                        at = t - change["seconds_ago"]
                        text = f"worker {change['worker_id']} {change['kind']} at {unit} "
                        text += str(change["step"])
                        event = {"t": at, "text": text}
                        self._events[key] = event
                        events.append(event)
            if self.sources.metrics:
                entry.update(self._scrape(self.sources.metrics[i]))
            shards.append(entry)
        for w in data["workers"]:
            clocks = [c for c in w["clocks"] if c is not None]
            workers[w["worker_id"]] = {
                "clock": max(clocks, default=0),
                # A worker that left or was dropped falls behind by definition: not plotted.
                "staleness": w["staleness"] if w["live"] else None,
                "live": w["live"],
            }
        fresh: dict[int, dict[str, Any]] = {}
        if self._tail is not None:
            for report in self._tail.read():
                figures = fresh.setdefault(report["worker"], {})
                for name, value in report.items():
                    if name != "worker" and _reported_figure(value):
                        figures[name] = value
        with self._lock:
            for worker, figures in fresh.items():
                held = self._reported.setdefault(worker, {})
                rate = _rate(
                    figures.get("step"), held.get("step"), figures.get("t", 0) - held.get("t", 0)
                )
                held.update(figures)
                if rate is not None:  # since its previous read: in DiLoCo over outer steps
                    held["steps_per_s"] = rate
            for worker, reported in self._reported.items():
                # A live worker's newest figures hold until its next line; one that left or
                # was dropped shows only what it wrote since the last sample.
                live = workers.get(worker, {}).get("live", False)
                chosen = reported if live else fresh.get(worker)
                if chosen:
                    figures = workers.setdefault(worker, {})
                    figures.update({k: v for k, v in chosen.items() if k not in NOT_CHARTED})
            sample = Sample(t, shards, workers, events)
            self._samples.append(sample)
        return sample

    def _scrape(self, address: str) -> dict[str, Any]:
        url = f"http://{address}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=self.sources.timeout) as reply:
                return parse_metrics(reply.read().decode("utf-8"))
        except (OSError, ValueError) as exc:
            return {"metrics_error": f"{url}: {exc}"}

    def series(self) -> dict[str, Any]:
        """The samples as the page's charts (see the module's docstring)."""
        with self._lock:
            samples = list(self._samples)
            events = sorted(self._events.values(), key=lambda e: e["t"])
            reported = {w: dict(figures) for w, figures in self._reported.items()}
        return build_series(samples, events, len(self.sources.shards), reported, self.sources)


def _rate(now: float | None, before: float | None, dt: float) -> float | None:
    if now is None or before is None or dt <= 0 or now < before:  # a restart resets counters
        return None
    return (now - before) / dt


Get = Callable[[Sample], Any]  # one figure of a sample (None: not known then)


def build_series(
    samples: Sequence[Sample],
    events: Sequence[dict[str, Any]],
    num_shards: int,
    reported: dict[int, dict[str, Any]] | None = None,
    sources: DashboardSources | None = None,
    window_s: float = RATE_WINDOW_S,
) -> dict[str, Any]:
    """Charts of ``samples``: each a title, a unit and named series aligned with ``t``
    (``None`` where there is no value: before a rate's second sample, an unreachable source,
    a worker not yet reporting; rates are means over the last ``window_s`` seconds), and a
    ``note`` saying why a chart is empty. ``steps`` and
    ``step_unit``: the newest worker's clock on the shards and what it counts (outer steps in
    a DiLoCo job, whose ``diloco`` settings the shards' Status names); ``workers``: one row
    per worker, from the last sample and the newest figures each ``reported``; ``sources``
    (what the dashboard reads) words the notes."""
    t = [s.t for s in samples]
    worker_ids = sorted({w for s in samples for w in s.workers})
    shard_names = [f"shard {i}" for i in range(num_shards)]
    last = samples[-1] if samples else None
    diloco = _diloco(samples)

    # Rates compare each sample with the oldest one within window_s before it (the one before
    # when none is) that has the figure and does not exceed it (a restart resets counters):
    # counters that move less often than once a sample, as a DiLoCo job's outer steps do,
    # read as their mean rate, not as 0 and 1 by turns.
    first = [None, *(min(bisect_left(t, t[i] - window_s), i - 1) for i in range(1, len(t)))]

    def base(i: int, get: Get) -> int | None:
        now, j = get(samples[i]), first[i]
        if now is None or j is None:
            return None
        return next(
            (k for k in range(j, i) if (v := get(samples[k])) is not None and v <= now), None
        )

    def values(get: Get, scale: float = 1.0) -> list[Any]:
        return [None if (v := get(s)) is None else v * scale for s in samples]

    def rates(get: Get, scale: float = 1.0) -> list[Any]:
        out = []
        for i, s in enumerate(samples):
            j = base(i, get)
            dt = 0.0 if j is None else s.t - samples[j].t
            out.append(None if j is None or dt <= 0 else (get(s) - get(samples[j])) / dt * scale)
        return out

    def means(total: Get, count: Get) -> list[Any]:  # e.g. seconds waited per call
        out: list[Any] = []
        for i, s in enumerate(samples):
            j = base(i, count)
            if j is None:
                out.append(None)
                continue
            calls = count(s) - count(samples[j])
            out.append((total(s) - total(samples[j])) / calls if calls > 0 else 0.0)
        return out

    def worker(w: int, name: str) -> Get:
        return lambda s: s.workers.get(w, {}).get(name)

    def shard(j: int, name: str) -> Get:
        return lambda s: s.shards[j].get(name)

    def per_worker(series: Callable[[Get], list[Any]], name: str) -> dict[str, list[Any]]:
        return {f"worker {w}": series(worker(w, name)) for w in worker_ids}

    def per_shard(series: Callable[[Get], list[Any]], name: str) -> dict[str, list[Any]]:
        return {n: series(shard(j, name)) for j, n in enumerate(shard_names)}

    kib, mib = 1.0 / (1 << 10), 1.0 / (1 << 20)
    in_mib = functools.partial(values, scale=mib)
    rss = {**per_shard(in_mib, "rss"), **per_worker(in_mib, "rss")}
    loss = per_worker(values, "loss")
    updates = per_shard(rates, "clock")
    steps = {**per_worker(rates, "clock"), **{f"{k} updates": v for k, v in updates.items()}}
    spread = per_shard(values, "spread")
    staleness = {**per_worker(values, "staleness"), **{f"{k} spread": v for k, v in spread.items()}}
    in_kib = functools.partial(rates, scale=kib)
    bytes_in, bytes_out = per_shard(in_kib, "bytes_in"), per_shard(in_kib, "bytes_out")
    wait = {
        n: means(shard(j, "wait_sum"), shard(j, "wait_count")) for j, n in enumerate(shard_names)
    }
    worker_bytes = {  # totals since the worker started, from its report lines
        f"worker {w} {way}": in_mib(worker(w, f"bytes_{way}_total"))
        for w in worker_ids
        for way in ("sent", "received")
    }
    title = _titles(diloco)
    charts = [
        ("steps", steps), ("loss", loss), ("wait", wait), ("staleness", staleness),
        ("bytes_in", bytes_in), ("bytes_out", bytes_out), ("worker_bytes", worker_bytes),
        ("refused", per_shard(rates, "refused")), ("rss", rss),
    ]  # fmt: skip
    newest = max((w.get("clock") or 0 for w in last.workers.values()), default=0) if last else 0
    out = []
    for i, series in charts:
        finite = _finite(series)
        empty = not any(v is not None for vs in finite.values() for v in vs)
        note = _empty_note(i, sources) if empty and samples else None
        out.append({"id": i, **title[i], "series": finite, "note": note})
    return {
        "t": t,
        "steps": newest,
        "step_unit": "outer steps" if diloco else "steps",
        "diloco": diloco,
        "samples": len(samples),
        "charts": out,
        "workers": _workers(last, reported or {}),
        "events": list(events),
        "errors": _errors(last),
    }


def _diloco(samples: Sequence[Sample]) -> dict[str, Any] | None:
    """The local-step settings of the job, as the newest shard that answered names them."""
    for sample in reversed(samples):
        for shard in sample.shards:
            if not shard.get("error") and "diloco" in shard:
                return dict(shard["diloco"]) if shard["diloco"] else None
    return None


def _titles(diloco: dict[str, Any] | None) -> dict[str, dict[str, str]]:
    """Each chart's title and unit; in a DiLoCo job the shards' clocks, and so the steps/s,
    staleness and membership steps, count outer steps, and the bytes are pseudo-gradients."""
    step, gradients, wait = "steps", "gradients", "mean per pull/push"
    if diloco is not None:
        each = diloco["between"]
        step, gradients = "outer steps", "pseudo-gradients"
        wait = "mean per pull/push, at outer steps"
    charts = {
        "steps": (
            f"Outer steps/s per worker (each after {each}); shards' outer updates/s"
            if diloco is not None
            else "Steps/s per worker; shards' optimizer updates/s",
            f"{step}/s",
        ),
        "loss": ("Loss per worker (reported by the script)", "loss"),
        "wait": (f"Sync round wait per shard ({wait})", "s"),
        "staleness": (
            f"Staleness per worker ({step} behind the newest); clock spread per shard",
            step,
        ),
        "bytes_in": (f"Bytes in per shard ({gradients})", "KiB/s"),
        "bytes_out": ("Bytes out per shard (weights)", "KiB/s"),
        "worker_bytes": (
            f"Bytes per worker since it started: sent ({gradients}), received (weights)",
            "MiB",
        ),
        "refused": ("Refused requests per shard", "calls/s"),
        "rss": ("Resident memory (RSS)", "MiB"),
    }
    return {k: {"title": title, "unit": unit} for k, (title, unit) in charts.items()}


def _empty_note(chart: str, sources: DashboardSources | None) -> str | None:
    """Why ``chart`` has nothing to plot (None: nothing to say)."""
    no_reports = sources is not None and sources.reports is None
    no_metrics = sources is not None and not sources.metrics
    if chart in ("loss", "worker_bytes") and no_reports:
        return (
            "needs the workers' reports: psctl dashboard --reports DIR (the job's $PS_REPORT_DIR)"
        )
    if chart in ("wait", "bytes_in", "bytes_out", "refused") and no_metrics:
        return "needs the shards' /metrics: psserver --metrics-port, psctl dashboard --metrics"
    if chart == "loss":
        return (
            "no worker has reported a loss: the training script calls opt.report(loss=loss) "
            "(or psworker.report(client, loss=...)) in its loop"
        )
    if chart == "worker_bytes":
        return (
            "no step report yet: DistributedOptimizer writes one at most once a second, "
            "in DiLoCo at outer steps"
        )
    return None


def _workers(last: Sample | None, reported: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per worker: its clock on the shards (outer steps in DiLoCo), whether it is
    live, and its newest report: its own step count (inner steps in DiLoCo) and steps/s
    between its last two reads, the last step's bytes sent and received (per outer step in
    DiLoCo), the totals, the loss."""
    status = last.workers if last is not None else {}
    rows = []
    for w in sorted(set(status) | set(reported)):
        figures = reported.get(w, {})
        rows.append(
            {
                "worker": w,
                "clock": status.get(w, {}).get("clock"),
                "live": status.get(w, {}).get("live"),
                "step": figures.get("step"),
                "steps_per_s": figures.get("steps_per_s"),
                **{k: figures.get(k) for k in WORKER_FIGURES},
                "reported_at": figures.get("t"),
            }
        )
    return [{k: _finite_number(v) for k, v in row.items()} for row in rows]


# The figures of a worker's newest report shown in the workers' table.
WORKER_FIGURES = (
    "bytes_sent", "bytes_received", "bytes_sent_total", "bytes_received_total", "loss",
)  # fmt: skip


def _reported_figure(value: Any) -> bool:
    """Whether a report line's ``value`` is one to keep: a finite number, or None (a gap). A
    line is any file's in the folder: text, a bool or a NaN there is left out, not plotted."""
    return value is None or (not isinstance(value, bool) and _finite_number(value) is not None)


def _finite_number(value: Any) -> Any:
    """``value`` if it is a finite number (or a bool, e.g. ``live``), else None."""
    return value if isinstance(value, int | float) and math.isfinite(value) else None


def _finite(series: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: [_finite_number(v) for v in vs] for k, vs in series.items()}


def _errors(last: Sample | None) -> list[str]:
    if last is None:
        return []
    out = []
    for i, shard in enumerate(last.shards):
        for key in ("error", "metrics_error"):
            if shard.get(key):
                out.append(f"shard {i}: {shard[key]}")
    return out
