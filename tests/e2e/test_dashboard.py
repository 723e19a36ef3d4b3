"""``psctl dashboard`` on a real job: 2 shard daemons, 2 reporting workers, the page opened in
headless Chromium (Debian's package), its figures read from the rendered page and a
screenshot saved under ``out/``."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from dashboard_pages import browse, chromium, metered_shards, series, start_dashboard, wait_for
from e2e_support import REPO, Lines, Processes, child_env

WORKER = str(REPO / "tests" / "e2e" / "reporting_worker.py")
SCREENSHOT = REPO / "out" / "dashboard.png"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = (
    "steps", "loss", "wait", "staleness", "bytes_in", "bytes_out", "worker_bytes", "refused", "rss",
)  # fmt: skip


@pytest.mark.timeout(240)
def test_the_dashboard_shows_a_live_two_shard_two_worker_job_in_chromium(
    procs: Processes, tmp_path: Path
) -> None:
    browser = chromium()
    shards, metrics = metered_shards(procs)
    addresses = ",".join(shards)
    reports = tmp_path / "reports"
    env = child_env(PS_REPORT_DIR=str(reports))
    # Worker 1 leaves after a few seconds: its leaving is a membership change on the axis.
    workers = [
        Lines(procs.start([sys.executable, WORKER, addresses, "0", "2", "120"], env)),
        Lines(procs.start([sys.executable, WORKER, addresses, "1", "2", "6"], env)),
    ]
    url = start_dashboard(procs, shards, metrics, reports, tmp_path)

    # The sources reach the page's data: steps, the workers' loss, every shard's metrics.
    def ready() -> dict[str, Any] | None:
        data = series(url)
        charts = {c["id"]: c["series"] for c in data["charts"]}

        def has(chart: str, name: str) -> bool:
            return any(v is not None for v in charts[chart].get(name, []))

        full = (
            data["steps"] > 0
            and all(has("loss", f"worker {w}") for w in (0, 1))
            and all(has("bytes_in", f"shard {s}") for s in (0, 1))
            and all(has("rss", f"shard {s}") for s in (0, 1))
            and any("worker 1 left" in e["text"] for e in data["events"])
        )
        return data if full else None

    data = wait_for(ready, 90.0, f"the job's figures at {url}api/series")
    assert [c["id"] for c in data["charts"]] == list(CHARTS)
    assert not data["errors"], data["errors"]
    left = next(e for e in data["events"] if "worker 1 left" in e["text"])
    assert data["t"][0] - 60 <= left["t"] <= data["t"][-1] + 1

    # The page as Chromium renders it: eight charts drawn by uPlot, the counter moving.
    def steps_on_page() -> tuple[int, str]:
        dom = browse(browser, tmp_path / "profile", url, "--dump-dom")
        found = re.search(r'id="steps">(\d+)<', dom)
        assert found, dom[:3000]
        return int(found.group(1)), dom

    first, dom = steps_on_page()
    assert dom.count('class="uplot') == len(CHARTS), dom[:3000]
    assert int(re.search(r'data-refreshes="(\d+)"', dom).group(1)) >= 1  # type: ignore[union-attr]
    assert "worker 1 left at step" in dom
    assert not re.search(r'id="errors">[^<]', dom), dom[:3000]
    second, _ = wait_for(
        lambda: (found := steps_on_page()) and found[0] > first and found, 60.0, "more steps"
    )
    assert second > first > 0

    shot = tmp_path / "dashboard.png"
    browse(browser, tmp_path / "profile", url, "--window-size=1280,1400", f"--screenshot={shot}")
    png = shot.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    SCREENSHOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT)
    assert all(w.text() is not None for w in workers)  # their output was drained
