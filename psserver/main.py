"""The ``psserver`` daemon: serve one shard until SIGTERM or SIGINT, then stop gracefully."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from pathlib import Path

from psserver.config import ServerConfig, parse_config
from psserver.server import start_server
from psserver.shard import Shard

log = logging.getLogger("psserver")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psserver`` / ``python -m psserver``; returns the exit code."""
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda num, frame: stop.set())
    return serve(config, stop)


def serve(config: ServerConfig, stop: threading.Event) -> int:
    """Runs a shard until ``stop`` is set; returns 0, or 1 when the port cannot be bound."""
    try:
        server = start_server(Shard(config.limits), config.host, config.port, config.threads)
    except RuntimeError as exc:
        log.error("psserver could not start on %s:%d: %s", config.host, config.port, exc)
        return 1
    try:
        log.info("psserver listening on %s:%d", config.host, server.port)
        if config.port_file is not None:
            write_port_file(config.port_file, server.port)
        stop.wait()
        log.info("psserver stopping (grace %.1fs)", config.grace_s)
    finally:
        server.stop(config.grace_s)
        if config.port_file is not None:
            # A port file outliving the daemon would point launchers at a dead or reused port.
            config.port_file.unlink(missing_ok=True)
    log.info("psserver stopped")
    return 0


def write_port_file(path: Path, port: int) -> None:
    """Writes ``port`` to ``path`` so a reader sees either nothing or the whole number."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
