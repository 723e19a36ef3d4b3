"""Consistency rules as plug-ins: when a push applies and when a pull may read."""

from __future__ import annotations

from pscore.job import check_mode
from psserver.consistency.asynchronous import AsyncPolicy
from psserver.consistency.base import Clocks, ConsistencyPolicy
from psserver.consistency.ssp import StalenessPolicy
from psserver.consistency.sync import SyncPolicy


def make_policy(mode: str, staleness: int = 0, quorum: int = 0) -> ConsistencyPolicy:
    """Builds the policy for a job's mode.

    Raises:
        InvalidRequestError: unknown mode, a negative staleness or quorum.
    """
    check_mode(mode, staleness, quorum)
    if mode == "sync":
        return SyncPolicy(quorum)
    if mode == "async":
        return AsyncPolicy()
    return StalenessPolicy(staleness)


__all__ = [
    "AsyncPolicy",
    "Clocks",
    "ConsistencyPolicy",
    "StalenessPolicy",
    "SyncPolicy",
    "make_policy",
]
