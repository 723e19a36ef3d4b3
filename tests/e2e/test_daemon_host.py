"""Where a psserver started without --host listens: only this machine when it has neither TLS
nor a token, every interface when either guards it, wherever --host/PS_HOST says otherwise;
the start-up log says which and why."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from e2e_support import (
    SERVING,
    START_TIMEOUT_S,
    Processes,
    child_env,
    health_status,
    wait_port_file,
)

LISTEN = "0A"  # /proc/net/tcp's state of a listening socket
_MAPPED = "0000000000000000FFFF0000"  # an IPv4-mapped IPv6 address's first 96 bits, as listed


def listening_hosts(port: int) -> set[str]:
    """The local addresses listening on ``port``, read from /proc/net/tcp and tcp6: dotted
    IPv4 (IPv4-mapped IPv6 too); "0.0.0.0" also for IPv6's any-address (dual stack)."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != LISTEN or int(hex_port, 16) != port:
                continue
            if len(address) == 32 and address[:24] not in (_MAPPED, "0" * 24):
                hosts.add(f"ipv6 {address}")
                continue
            word = address[-8:]  # IPv4, or the IPv4 of a mapped or any-address, host order
            hosts.add(".".join(str(int(word[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return hosts


def start(procs: Processes, tmp_path: Path, *flags: str, **env: str) -> tuple[int, str]:
    """Starts psserver with ``flags`` (no --host unless given), waits until it serves, stops
    it; returns (port, its output)."""
    port_file = tmp_path / "ps.port"
    args = [sys.executable, "-m", "psserver", "--port", "0", "--port-file", str(port_file)]
    proc = procs.start([*args, *flags], env=child_env(**env))
    port = wait_port_file(proc, port_file, START_TIMEOUT_S)
    assert health_status(f"127.0.0.1:{port}", START_TIMEOUT_S) == SERVING
    hosts = listening_hosts(port)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    return port, f"{sorted(hosts)}\n{out}"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "env", "host", "note"),
    [
        ([], {}, "127.0.0.1", "serving this machine only (127.0.0.1): no --host given"),
        ([], {"PS_TOKEN": "s3cret"}, "0.0.0.0", "serving every interface (0.0.0.0)"),
        (["--host", "0.0.0.0"], {}, "0.0.0.0", None),
        ([], {"PS_HOST": "0.0.0.0"}, "0.0.0.0", None),
        (["--host", "127.0.0.1"], {"PS_TOKEN": "s3cret"}, "127.0.0.1", None),
    ],
    ids=["plain", "token", "flag", "env-twin", "flag-with-token"],
)
def test_default_host_serves_this_machine_only_without_tls_or_token(
    procs: Processes,
    tmp_path: Path,
    flags: list[str],
    env: dict[str, str],
    host: str,
    note: str | None,
) -> None:
    port, out = start(procs, tmp_path, *flags, **env)
    assert out.startswith(f"['{host}']"), out
    assert f"psserver listening on {host}:{port}" in out
    if note is None:
        assert "no --host given" not in out, out
    else:
        assert note in out, out
