"""A misspelt PS_* variable is named, with the closest known one, by connect() and by every
daemon (psserver, psworker, psctl), instead of being silently ignored."""

from __future__ import annotations

import signal
import sys

import pytest
from e2e_support import Processes, child_env

HINT = "$PS_SHRADS is not a variable psgrpc reads (ignored); did you mean $PS_SHARDS?"


@pytest.mark.timeout(60)
def test_connect_warns_of_a_misspelt_variable(procs: Processes) -> None:
    # The user meant a cluster; without the warning this trains alone in local mode.
    code = "import psworker; print(type(psworker.connect()).__name__)"
    env = child_env(PS_SHRADS="127.0.0.1:1")
    status, out = procs.run([sys.executable, "-c", code], timeout=45, env=env)
    assert status == 0, out
    assert f"connect(): {HINT}" in out, out
    assert "LocalClient" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "who,args",
    [
        ("psworker", ["-m", "psworker", "run", "nope.py"]),
        ("psctl", ["-m", "psctl", "status", "--help"]),
    ],
)
def test_the_commands_warn_of_a_misspelt_variable(
    procs: Processes, who: str, args: list[str]
) -> None:
    status, out = procs.run([sys.executable, *args], timeout=45, env=child_env(PS_SHRADS="x"))
    assert f"{who}: {HINT}" in out, out
    assert status == (2 if who == "psworker" else 0), out  # no such script; --help


@pytest.mark.timeout(60)
def test_the_shard_daemon_warns_of_a_misspelt_variable(procs: Processes) -> None:
    daemon = procs.psserver(env=child_env(PS_SHRADS="x", PS_HEARTBEAT_TIMEOUT="5"))
    daemon.proc.send_signal(signal.SIGTERM)
    out, _ = daemon.proc.communicate(timeout=30)
    assert f"psserver: {HINT}" in out, out
