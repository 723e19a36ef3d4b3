"""The one list of ``PS_*`` environment variables the project reads, and the warning for others.

A misspelt variable (``PS_SHRADS``) is otherwise silently ignored: the worker trains alone in
local mode. ``connect()`` and every daemon (``psserver``, ``psworker``, ``psctl``) call
``warn_unknown`` once at start, which names the closest known variable. A name read anywhere
in the project (code, scripts, deploy files, tests) belongs here; ``tests/unit/test_envnames.py``
checks the sources against this list.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

# The client SDK (connect(), psworker run) and the launchers that feed it.
_WORKER = (
    "PS_SHARDS", "PS_SHARDS_FILE", "PS_WORKER_ID", "PS_NUM_WORKERS", "PS_MODE", "PS_STALENESS",
    "PS_ELASTIC", "PS_CLUSTER", "PS_TASK_INDEX", "PS_JOB_ID", "PS_REPLAY_BYTES",
    "PS_COMPRESSION", "PS_STALL_WARNING", "PS_REPORT_DIR",
    "PS_DATA_PLANE", "PS_GRPC_BELOW_BYTES", "PS_PART_BYTES", "PS_LOCAL_STEPS", "PS_TUNE_MALLOC",
    "PS_WORKER_STATE_DIR",
)  # fmt: skip
# Security, read by the client, the shard and psctl alike.
_SECURITY = ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_TOKEN", "PS_TOKEN_FILE")
# psserver's flags' twins.
_SHARD = (
    "PS_HOST", "PS_PORT", "PS_PORT_FILE", "PS_THREADS", "PS_MAX_REQUEST_BYTES",
    "PS_MAX_INFLIGHT_BYTES", "PS_MAX_WORKERS", "PS_MAX_VARIABLES", "PS_MAX_WAIT",
    "PS_MAX_STEP_AHEAD", "PS_HEARTBEAT_TIMEOUT", "PS_MEMORY_LIMIT", "PS_TABLE_FILES",
    "PS_STREAM_IDLE_TIMEOUT",
    "PS_METRICS_HOST", "PS_METRICS_PORT", "PS_LOG_LEVEL", "PS_LOG_FORMAT", "PS_GRACE",
    "PS_CHECKPOINT_DIR", "PS_CHECKPOINT_EVERY_STEPS", "PS_CHECKPOINT_EVERY_SECS",
    "PS_KEEP_CHECKPOINTS", "PS_SHARD_NAME", "PS_DATA_PORT", "PS_FRESH",
    "PS_PROBE_TLS_CERT", "PS_PROBE_TLS_KEY",
)  # fmt: skip
# psctl's flags' twins.
_PSCTL = (
    "PS_SERVERS", "PS_WORKERS", "PS_RUN_TIMEOUT", "PS_START_TIMEOUT", "PS_RUN_DIR",
    "PS_ADD_COUNT", "PS_ADD_TIMEOUT", "PS_SHARD_TIMEOUT", "PS_STATUS_JSON", "PS_EXPORT_OUT",
    "PS_CERTS_OUT", "PS_CERTS_HOSTS", "PS_CERTS_DAYS", "PS_CERTS_FORCE", "PS_DEMO_EPOCHS",
    "PS_DEMO_OUT", "PS_DEMO_SEED", "PS_EXPORT", "PS_STATUS_WATCH", "PS_NNODES",
    "PS_NODE_RANK", "PS_RDZV", "PS_JOIN_TIMEOUT", "PS_NODE_TIMEOUT", "PS_DASHBOARD_HOST",
    "PS_DASHBOARD_PORT", "PS_DASHBOARD_PORT_FILE", "PS_DASHBOARD_INTERVAL", "PS_DASHBOARD_METRICS",
)  # fmt: skip
# Set-up, deploy and test tooling (scripts/, deploy/, tests/): set in the same shells.
_TOOLING = (
    "PS_PYTHON", "PS_TORCH_SPEC", "PS_VENV", "PS_BASE_PORT", "PS_NUM_SHARDS",
    "PS_NUM_WORKERS_PER_NODE", "PS_SERVER_IMAGE", "PS_WORKER_IMAGE", "PS_IMAGES_CACHE",
    "PS_IMAGES_CLUSTERS", "PS_IMAGES_MIN_ACCURACY", "PS_IMAGES_MIRROR", "PS_IMAGES_NOFILE",
    "PS_IMAGES_NPROC", "PS_SOAK_S", "PS_FUZZ_SEED",
)  # fmt: skip

KNOWN: frozenset[str] = frozenset(_WORKER + _SECURITY + _SHARD + _PSCTL + _TOOLING)

_warned: set[str] = set()


def unknown(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``PS_*`` name in ``environ`` (default ``os.environ``) that no part of the project
    reads, sorted, with the closest known name (None when nothing is close)."""
    env = os.environ if environ is None else environ
    found = []
    for name in sorted(env):
        if name.startswith("PS_") and name not in KNOWN:
            close = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.6)
            found.append((name, close[0] if close else None))
    return found


def warn_unknown(environ: Mapping[str, str] | None = None, who: str = "") -> list[str]:
    """Logs a WARNING for each unknown ``PS_*`` variable (once per name and process);
    returns the messages logged."""
    messages = []
    for name, close in unknown(environ):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean ${close}?" if close else ""
        prefix = f"{who}: " if who else ""
        messages.append(f"{prefix}${name} is not a variable psgrpc reads (ignored){hint}")
        log.warning("%s", messages[-1])
    return messages
