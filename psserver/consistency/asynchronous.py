"""Asynchronous rule: every push applies on arrival; pulls never wait."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psserver.consistency.base import Clocks, ConsistencyPolicy


class AsyncPolicy(ConsistencyPolicy):
    name = "async"

    def submit(
        self,
        clocks: Clocks,
        worker: int,
        step: int,
        grads: Mapping[str, Any],
        owned: bool = False,
    ) -> Mapping[str, Any] | None:
        return grads
