"""``psctl dashboard`` for the dashboard's end-to-end tests: shard daemons with ``/metrics``,
the dashboard over them, and reading it as its users do: its JSON series, and its page as
headless Chromium (Debian's package) renders it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_support import Processes, child_env, wait_port_file


def chromium() -> str:
    """Chromium's path; skips the test where it is not installed."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium is not installed (apt-get install chromium; scripts/dev.sh test does)")


def browse(browser: str, profile: Path, url: str, *args: str) -> str:
    """Chromium, headless, on ``url`` with ``args``; its stdout. The page's scripts get 4 s of
    (virtual) time to fetch and draw before the DOM or screenshot is taken."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    command += [f"--user-data-dir={profile}", "--virtual-time-budget=4000", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def series(url: str) -> dict[str, Any]:
    """What the page polls: ``/api/series`` of the dashboard at ``url``."""
    with urllib.request.urlopen(url + "api/series", timeout=10) as reply:
        return json.loads(reply.read())


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """The first true value of ``predicate()``, polled every 0.25 s; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"gave up after {timeout:g}s waiting for {what}")


def metered_shards(procs: Processes, n: int = 2) -> tuple[list[str], list[str]]:
    """``n`` psserver daemons, each with ``--metrics-port``: their addresses and their
    ``/metrics`` host:port."""
    metered = [procs.metered_psserver() for _ in range(n)]
    return [s.address for s, _ in metered], [f"127.0.0.1:{port}" for _, port in metered]


def start_dashboard(
    procs: Processes, addresses: list[str], metrics: list[str], reports: Path, folder: Path
) -> str:
    """``psctl dashboard`` on the shards at ``addresses`` (reading every 0.5 s), on a free
    port; the page's URL once it serves."""
    port_file = folder / "dashboard.port"
    dashboard = procs.start(
        [
            sys.executable, "-m", "psctl.main", "dashboard", *addresses,
            "--metrics", ",".join(metrics), "--reports", str(reports), "--port", "0",
            "--port-file", str(port_file), "--interval", "0.5",
        ],
        child_env(),
    )  # fmt: skip
    return f"http://127.0.0.1:{wait_port_file(dashboard, port_file, 30.0)}/"
