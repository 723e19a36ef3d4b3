"""Free ports for tests that must name a port before a process binds it (a daemon's
``--metrics-port``, a rendezvous store's).

A port the kernel hands out for ``bind(port 0)`` lies in its ephemeral range, the range it
also draws every outgoing connection's local port from: between the test picking it and the
process binding it, any connection on the machine (this suite's own gRPC clients, another job's)
can take it. So these ports are drawn below that range, where only a listener that chose the
same number could take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on right now (bound and closed again at once), below the
    ephemeral range; a port from ``bind(port 0)`` if none of 200 tries there is free."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens (see ``free_port``): a connection is refused."""
    return f"127.0.0.1:{free_port()}"
