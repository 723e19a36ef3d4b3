"""Channel and server options both ends use, and the channel factory."""

from __future__ import annotations

import re

import grpc

from pswire.codec import DEFAULT_CHUNK_BYTES
from pswire.errors import ConfigError

# Messages carry at most one chunk plus a small header; leave generous headroom so a peer with a
# larger configured chunk still gets through, while a huge unary message is refused.
MAX_MESSAGE_BYTES = max(64 << 20, 4 * DEFAULT_CHUNK_BYTES)

OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect soon after a refused connection (grpc waits 1 s, then longer): workers and
    # ring peers start together, and a shard restarts in a second or two.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


# Bind addresses meaning "every interface": a client reaches such a server on loopback.
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


# host:port or [v6]:port; and the gRPC target schemes that carry their own form.
_HOST_PORT = re.compile(r"(?:\[[^\]]+\]|[^:\[\]/\s]+):(?P<port>\d+)")
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_address(address: str) -> str:
    """Returns ``address`` if it is ``host:port``, ``[v6addr]:port`` or a gRPC target with a
    scheme (``dns:///host:port``, ``unix:path``).

    Raises:
        ConfigError: no port (gRPC would silently dial 443) or a port out of range.
    """
    if address.startswith(_SCHEMES):
        return address
    match = _HOST_PORT.fullmatch(address)
    if match is None:
        raise ConfigError(
            f"address {address!r} is not host:port (e.g. 'localhost:7001', '[::1]:7001'); "
            "without a port gRPC would dial 443"
        )
    if not 0 < int(match["port"]) < 65536:
        raise ConfigError(f"address {address!r}: port {match['port']} is not in 1..65535")
    return address


def insecure_channel(address: str) -> grpc.Channel:
    """A channel to ``host:port`` with the project's message limits and keepalive."""
    return grpc.insecure_channel(address, options=OPTIONS)


def wait_ready(channel: grpc.Channel, timeout: float) -> None:
    """Blocks until the channel connects.

    Raises:
        grpc.FutureTimeoutError: not connected within ``timeout`` seconds.
    """
    grpc.channel_ready_future(channel).result(timeout=timeout)
