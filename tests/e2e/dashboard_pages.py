"""Reading ``psctl dashboard`` as its users do, for the dashboard's end-to-end tests: its JSON
series, and its page as headless Chromium (Debian's package) renders it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest


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
