"""End-to-end fixtures: daemons as real subprocesses, every one reaped by PID after the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import Processes


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Subprocess launcher whose children (and adopted grandchildren) die with the test."""
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.reap()
