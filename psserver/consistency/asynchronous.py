"""Asynchronous rule: every push applies on arrival; pulls never wait."""

from __future__ import annotations

from psserver.consistency.base import ConsistencyPolicy


class AsyncPolicy(ConsistencyPolicy):
    name = "async"
