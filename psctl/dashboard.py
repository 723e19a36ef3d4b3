"""``psctl dashboard``'s data: samples of the shards' Status and ``/metrics`` and the workers'
reports, kept as time series for the page to plot.

A ``Sampler`` reads every source once per interval (a read never changes a shard) and keeps
the last ``history`` samples; ``series()`` turns them into what the page draws: per worker
steps/s, loss, staleness and RSS, per shard sync round wait, bytes in and out, refused
requests and RSS, and the membership changes as marks on the time axis.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
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
                entry["spread"] = shard["max_staleness"]
                for change in shard["membership"]["history"]:
                    key = (change["kind"], change["worker_id"], change["step"])
                    if key not in self._events:
                        at = t - change["seconds_ago"]
                        text = f"worker {change['worker_id']} {change['kind']} at step "
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
        if self._tail is not None:
            for report in self._tail.read():
                figures = workers.setdefault(report["worker"], {})
                for name, value in report.items():
                    if name not in ("t", "worker", "step"):
                        figures[name] = value
        sample = Sample(t, shards, workers, events)
        with self._lock:
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
        return build_series(samples, events, len(self.sources.shards))


def _rate(now: float | None, before: float | None, dt: float) -> float | None:
    if now is None or before is None or dt <= 0 or now < before:  # a restart resets counters
        return None
    return (now - before) / dt


def build_series(
    samples: Sequence[Sample], events: Sequence[dict[str, Any]], num_shards: int
) -> dict[str, Any]:
    """Charts of ``samples``: each a title, a unit and named series aligned with ``t``
    (``None`` where there is no value: before a rate's second sample, an unreachable source,
    a worker not yet reporting)."""
    t = [s.t for s in samples]
    worker_ids = sorted({w for s in samples for w in s.workers})
    shard_names = [f"shard {i}" for i in range(num_shards)]

    def per_worker(value: Callable[[Sample, Sample | None, int], float | None]) -> dict:
        return {
            f"worker {w}": [
                value(s, samples[i - 1] if i else None, w) for i, s in enumerate(samples)
            ]
            for w in worker_ids
        }

    def per_shard(value: Callable[[dict, dict | None, float], float | None]) -> dict:
        out = {}
        for j, name in enumerate(shard_names):
            points = []
            for i, s in enumerate(samples):
                prev = samples[i - 1].shards[j] if i else None
                dt = s.t - samples[i - 1].t if i else 0.0
                points.append(value(s.shards[j], prev, dt))
            out[name] = points
        return out

    def worker_field(name: str) -> Callable[[Sample, Sample | None, int], float | None]:
        return lambda s, _p, w: s.workers.get(w, {}).get(name)

    def steps_rate(s: Sample, prev: Sample | None, w: int) -> float | None:
        if prev is None:
            return None
        return _rate(
            s.workers.get(w, {}).get("clock"), prev.workers.get(w, {}).get("clock"), s.t - prev.t
        )

    def counter(name: str, scale: float = 1.0) -> Callable[[dict, dict | None, float], Any]:
        def value(now: dict, prev: dict | None, dt: float) -> float | None:
            r = _rate(now.get(name), None if prev is None else prev.get(name), dt)
            return None if r is None else r * scale

        return value

    def round_wait(now: dict, prev: dict | None, _dt: float) -> float | None:
        if prev is None or "wait_count" not in now or "wait_count" not in prev:
            return None
        calls = now["wait_count"] - prev["wait_count"]
        return (now["wait_sum"] - prev["wait_sum"]) / calls if calls > 0 else 0.0

    kib, mib = 1.0 / (1 << 10), 1.0 / (1 << 20)
    rss = {
        **{k: [None if v is None else v * mib for v in vs] for k, vs in per_shard(
            lambda now, _p, _d: now.get("rss")).items()},
        **{k: [None if v is None else v * mib for v in vs] for k, vs in per_worker(
            worker_field("rss")).items()},
    }  # fmt: skip
    loss = per_worker(worker_field("loss"))
    updates = per_shard(counter("clock"))
    steps = {**per_worker(steps_rate), **{f"{k} updates": v for k, v in updates.items()}}
    spread = per_shard(lambda now, _p, _d: now.get("spread"))
    staleness = {
        **per_worker(worker_field("staleness")),
        **{f"{k} spread": v for k, v in spread.items()},
    }
    bytes_in, bytes_out = per_shard(counter("bytes_in", kib)), per_shard(counter("bytes_out", kib))
    charts = [
        ("steps", "Steps/s per worker; shards' optimizer updates/s", "1/s", steps),
        ("loss", "Loss per worker (reported by the script)", "loss", loss),
        ("wait", "Sync round wait per shard (mean per pull/push)", "s", per_shard(round_wait)),
        ("staleness", "Staleness per worker; clock spread per shard", "steps", staleness),
        ("bytes_in", "Bytes in per shard (gradients)", "KiB/s", bytes_in),
        ("bytes_out", "Bytes out per shard (weights)", "KiB/s", bytes_out),
        ("refused", "Refused requests per shard", "calls/s", per_shard(counter("refused"))),
        ("rss", "Resident memory (RSS)", "MiB", rss),
    ]  # fmt: skip
    last = samples[-1] if samples else None
    newest = max((w.get("clock", 0) for w in last.workers.values()), default=0) if last else 0
    return {
        "t": t,
        "steps": newest,
        "samples": len(samples),
        "charts": [
            {"id": i, "title": title, "unit": unit, "series": _finite(series)}
            for i, title, unit, series in charts
        ],
        "events": list(events),
        "errors": _errors(last),
    }


def _finite(series: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {
        k: [v if isinstance(v, int | float) and math.isfinite(v) else None for v in vs]
        for k, vs in series.items()
    }


def _errors(last: Sample | None) -> list[str]:
    if last is None:
        return []
    out = []
    for i, shard in enumerate(last.shards):
        for key in ("error", "metrics_error"):
            if shard.get(key):
                out.append(f"shard {i}: {shard[key]}")
    return out
