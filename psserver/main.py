"""The ``psserver`` daemon: serve one shard until SIGTERM or SIGINT, then stop gracefully."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

from psserver.checkpoint import Checkpointer, CheckpointScheduler
from psserver.config import LOOPBACK_HOST, WILDCARD_HOST, ServerConfig, parse_config
from psserver.logformat import configure_logging
from psserver.metrics import MetricsServer, ShardMetrics
from psserver.server import start_server
from psserver.shard import Shard
from pswire import envnames
from pswire.cli import wait_for_stop, write_port_file
from pswire.errors import PSError
from pswire.flightwire import tune_malloc

log = logging.getLogger("psserver")
# mallopt's M_ARENA_MAX, and the arenas a shard keeps (see limit_malloc_arenas).
_M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def limit_malloc_arenas(count: int = MALLOC_ARENAS) -> bool:
    """Caps this process's glibc malloc arenas at ``count`` unless ``$MALLOC_ARENA_MAX`` says.

    glibc gives threads that allocate their own arenas (up to 8 per core); the 4 MiB messages
    gRPC's threads receive are then freed into many arenas that each keep them. Two arenas cut
    a shard's peak RSS from 2.2-2.5x to ~2.0x of its state, at no measured speed cost
    (bench/NOTES.md entry 11). The daemon's own process only; a no-op without glibc.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  # glibc only
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psserver`` / ``python -m psserver``; returns the exit code."""
    limit_malloc_arenas()  # before any thread allocates
    tune_malloc()  # Flight's message buffers reused, not faulted in again per message
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_format)
    envnames.warn_unknown(who="psserver")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda num, frame: stop.set())
    return serve(config, stop)


def serve(config: ServerConfig, stop: threading.Event) -> int:
    """Runs a shard until ``stop`` is set; returns 0, or 1 when it cannot start."""
    shard = Shard(config.limits)
    try:
        saver = open_checkpoints(config, shard)
    except (OSError, RuntimeError, PSError) as exc:
        log.error("psserver cannot use checkpoint directory %s: %s", config.checkpoint_dir, exc)
        return 1
    metrics = ShardMetrics(shard, config.shard_name) if config.metrics_port is not None else None
    try:
        server = start_server(
            shard,
            config.host,
            config.port,
            config.threads,
            config.security,
            checkpoint=saver.checkpoint if saver is not None else None,
            metrics=metrics,
            stream_idle_s=config.stream_idle_s,
            max_inflight_bytes=config.max_inflight_bytes,
            data_port=config.data_port,
        )
    except (RuntimeError, ValueError) as exc:
        log.error("psserver could not start on %s:%d: %s", config.host, config.port, exc)
        return 1
    exporter: MetricsServer | None = None
    if metrics is not None and config.metrics_port is not None:
        try:
            exporter = metrics.serve(config.metrics_host, config.metrics_port)
        except OSError as exc:
            log.error("psserver could not serve metrics on port %d: %s", config.metrics_port, exc)
            server.stop(0)
            return 1
        log.info("metrics at http://%s:%d/metrics", config.metrics_host, exporter.port)
    try:
        log.info(
            "psserver listening on %s:%d (%s); %s",
            config.host,
            server.port,
            config.security.describe(),
            f"Flight data port {server.data_port}"
            if server.data_port
            else "no data port: tensors travel on the gRPC port",
        )
        if not config.host_given:
            log.info(host_note(config))
        if config.security.token and not config.security.tls:
            log.warning(
                "the token travels in clear text: without TLS, use only on a trusted network"
            )
        if config.port_file is not None:
            write_port_file(config.port_file, server.port)
        if saver is not None:
            saver.start()
        wait_for_stop(stop)
        log.info("psserver stopping (grace %.1fs)", config.grace_s)
    finally:
        server.stop(config.grace_s)
        if exporter is not None:
            exporter.stop()
        if saver is not None:
            # After the server stopped: the final checkpoint holds every push it accepted.
            saver.close()
            saver.checkpointer.unlock()
        if config.port_file is not None:
            # A port file outliving the daemon would point launchers at a dead or reused port.
            config.port_file.unlink(missing_ok=True)
    log.info("psserver stopped")
    return 0


def host_note(config: ServerConfig) -> str:
    """The start-up line saying why a daemon started without ``--host`` listens where it does."""
    if config.host == LOOPBACK_HOST:
        return (
            f"serving this machine only ({LOOPBACK_HOST}): no --host given, and neither TLS nor "
            f"a token is set; pass --host {WILDCARD_HOST} (PS_HOST) to serve other machines"
        )
    return (
        f"serving every interface ({config.host}): no --host given, and "
        f"{config.security.describe()} guards the port; pass --host to choose one"
    )


def open_checkpoints(config: ServerConfig, shard: Shard) -> CheckpointScheduler | None:
    """Claims the checkpoint directory and restores ``shard`` from it; None without one.

    Raises:
        RuntimeError: another process uses the directory.
        OSError: the directory cannot be created or locked.
        PSError: the newest valid checkpoint does not fit a shard.
    """
    if config.checkpoint_dir is None:
        return None
    checkpointer = Checkpointer(config.checkpoint_dir, config.keep_checkpoints)
    checkpointer.lock()
    if config.fresh:
        aside = checkpointer.set_aside()
        if aside is not None:
            log.warning(
                "--fresh: the checkpoints in %s moved to %s (kept, not deleted): a new job starts",
                config.checkpoint_dir,
                aside,
            )
    saver = CheckpointScheduler(
        shard, checkpointer, config.checkpoint_every_steps, config.checkpoint_every_secs
    )
    state = saver.resume()
    if state is None:
        log.info("no valid checkpoint in %s: starting empty", config.checkpoint_dir)
    else:
        log.info(
            "restored from checkpoint in %s: shard clock %d, %d variables, mode %s",
            config.checkpoint_dir,
            state.updates,
            len(state.variables),
            state.job.mode,
        )
    return saver
