"""Asynchronous rule: every push applies on arrival; pulls never wait."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from psserver.consistency.base import Clocks, ConsistencyPolicy


class AsyncPolicy(ConsistencyPolicy):
    name = "async"

    def submit(
        self, clocks: Clocks, worker: int, step: int, grads: Mapping[str, np.ndarray]
    ) -> Mapping[str, np.ndarray] | None:
        return grads
