"""Consistency rules as plug-ins: when a push applies and when a pull may read."""

from __future__ import annotations

from psserver.consistency.asynchronous import AsyncPolicy
from psserver.consistency.base import Clocks, ConsistencyPolicy
from psserver.consistency.ssp import StalenessPolicy
from psserver.consistency.sync import SyncPolicy
from pswire.errors import InvalidRequestError

MODES = ("sync", "async", "ssp")


def make_policy(mode: str, staleness: int = 0, quorum: int = 0) -> ConsistencyPolicy:
    """Builds the policy for a job's mode.

    Raises:
        InvalidRequestError: unknown mode, a negative staleness or quorum.
    """
    if quorum < 0:
        raise InvalidRequestError(f"quorum must be >= 0, got {quorum}")
    if quorum and mode != "sync":
        raise InvalidRequestError(f"quorum (backup workers) is a sync option; mode is {mode!r}")
    if mode == "sync":
        return SyncPolicy(quorum)
    if mode == "async":
        return AsyncPolicy()
    if mode == "ssp":
        if staleness < 0:
            raise InvalidRequestError(f"ssp staleness must be >= 0, got {staleness}")
        return StalenessPolicy(staleness)
    raise InvalidRequestError(f"unknown mode {mode!r}; expected one of {list(MODES)}")


__all__ = ["MODES", "AsyncPolicy", "Clocks", "ConsistencyPolicy", "StalenessPolicy", "SyncPolicy"]
