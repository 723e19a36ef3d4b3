"""Soak: 4 async workers against 2 shards for minutes, every process's RSS sampled; memory must
not trend upwards (issue 14). Run it with ``pytest -m slow tests/e2e/test_soak.py``; $PS_SOAK_S
sets its length in seconds (default 600)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import pytest
from e2e_support import Lines, Processes, numpy_worker, rss_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc RSS")

MiB = 1 << 20
SOAK_S = float(os.environ.get("PS_SOAK_S", "600"))
SAMPLE_S = 3.0
WORKERS = 4
MODEL_FLOATS = 1 << 19  # 2 MiB of float32s, in 4 variables over the 2 shards
CEILING = 1536 * MiB  # any process above this fails the soak at once (a shared machine)
GROWTH = 0.10  # the last third's median may exceed the second third's by this fraction ...
GROWTH_FLOOR = 50 * MiB  # ... or by this much, whichever is larger


def trend(samples: list[int]) -> tuple[int, int]:
    """(median of the second third, median of the last third) of ``samples``."""
    third = len(samples) // 3
    return (
        int(statistics.median(samples[third : 2 * third])),
        int(statistics.median(samples[2 * third :])),
    )


# slow: it runs for PS_SOAK_S seconds (10 minutes by default), far longer than the default run
# may take; run it on purpose with -m slow.
@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_S) + 300)
def test_soak_four_async_workers_two_shards_memory_flat(procs: Processes, tmp_path: Path) -> None:
    # Shard 0 checkpoints on a timer; shard 1 has a checkpoint folder but no interval, so it
    # saves only when a worker's replay log is full and asks.
    shard_flags = [
        ["--checkpoint-dir", str(tmp_path / "ckpt0"), "--checkpoint-every-secs", "20"],
        ["--checkpoint-dir", str(tmp_path / "ckpt1")],
    ]
    shards = [procs.psserver(*flags) for flags in shard_flags]
    shard_logs = [Lines(s.proc) for s in shards]
    addresses = [s.address for s in shards]
    workers = [
        numpy_worker(
            procs,
            addresses,
            i,
            WORKERS,
            *("--mode", "async", "--duration", str(SOAK_S), "--floats", str(MODEL_FLOATS)),
            *("--pieces", "4", "--pace", "0.01", "--report-every", "50", "--timeout", "120"),
            *(["--fused"] if i % 2 else []),  # half fused (step streams), half pull + push
        )
        for i in range(WORKERS)
    ]
    for w in workers:
        w.wait_for(lambda w=w: w.latest("ready") is not None, 120, "init")
    names = [f"shard{i}" for i in range(len(shards))] + [f"worker{i}" for i in range(WORKERS)]
    pids = [s.proc.pid for s in shards] + [w.proc.pid for w in workers]
    samples: dict[str, list[int]] = {name: [] for name in names}
    times: list[float] = []
    start = time.monotonic()
    # Sample until the first worker is done (its duration is up): then every process is busy.
    while all(w.latest("done") is None and w.proc.poll() is None for w in workers):
        assert time.monotonic() - start < SOAK_S + 120, "the workers did not stop on time"
        for name, pid in zip(names, pids, strict=True):
            rss = rss_bytes(pid)
            samples[name].append(rss)
            assert rss < CEILING, f"{name} at {rss // MiB} MiB: {samples[name][::10]}"
        times.append(time.monotonic() - start)
        time.sleep(SAMPLE_S)
    for i, w in enumerate(workers):
        code = w.proc.wait(timeout=180)
        assert code == 0, f"worker {i} exited {code}:\n{w.text()}"
    for i, s in enumerate(shards):
        assert s.proc.poll() is None, f"shard {i} died:\n{shard_logs[i].text()}"
    steps = [w.latest("done") for w in workers]
    print(f"\nsoak {SOAK_S:.0f}s: steps per worker {steps}; {len(times)} samples (MiB):")
    print("t(s)   " + " ".join(f"{n:>8}" for n in names))
    for k, t in enumerate(times):
        print(f"{t:6.1f} " + " ".join(f"{samples[n][k] // MiB:8d}" for n in names))
    assert len(times) >= 9, f"too few samples ({len(times)}) to see a trend"
    assert all(s and s > 100 for s in steps), steps
    grew = {}
    for name in names:
        middle, last = trend(samples[name])
        print(f"{name}: median {middle // MiB} MiB (second third) -> {last // MiB} MiB (last)")
        if last - middle > max(GROWTH * middle, GROWTH_FLOOR):
            grew[name] = (middle // MiB, last // MiB)
    assert not grew, f"memory trends upwards (second-third -> last-third median, MiB): {grew}"
