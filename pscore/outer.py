"""Outer optimizers of local-step training (DiLoCo) that only a shard runs: the delayed Nesterov
rule of asynchronous DiLoCo, where each pseudo-gradient is applied on arrival.

Asynchronous Local-SGD (Liu et al., 2024, "Asynchronous Local-SGD Training for Language
Modeling") found that Nesterov momentum updated on every arriving pseudo-gradient overshoots
(momentum sees one stale worker's update at a time); their delayed Nesterov rule applies each
arrival's pseudo-gradient at once without momentum and updates the momentum only once per
``delay`` arrivals (a full set of workers' updates), from their mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from pscore.optim import Optimizer
from pswire.errors import ConfigError


@dataclass(frozen=True)
class DelayedNesterov(Optimizer):
    """Nesterov momentum updated once per ``delay`` pushes (asynchronous DiLoCo's outer step).

    Each push's gradient ``g`` is applied at once as ``param -= lr * g / delay`` and added to
    a pending sum; every ``delay``-th push the momentum takes the pending mean
    (``buf = momentum * buf + pending / delay``, as torch.optim.SGD's buffer) and the
    weights move by ``lr * momentum * buf``. Over ``delay`` pushes of gradients ``g_1..g_N``
    that is exactly one step of torch.optim.SGD(lr, momentum, nesterov=True) on their mean, so
    with ``delay`` set to the number of workers the asynchronous outer step matches the
    synchronous one when no worker is late, and momentum never acts on one worker's update
    alone. ``delay`` 1 is plain Nesterov SGD on each push.
    """

    name: ClassVar[str] = "delayed_nesterov"
    sparse: ClassVar[bool] = False
    lr: float = 0.7
    momentum: float = 0.9
    delay: int = 1

    def __post_init__(self) -> None:
        self._check_ranges(momentum=(0.0, 1.0))
        if not (float(self.delay).is_integer() and 1 <= self.delay <= 1 << 20):
            raise ConfigError(
                f"invalid delay: {self.delay} (expected a whole number of pushes, 1 <= delay "
                f"<= {1 << 20}: the number of workers whose updates one momentum step sees)"
            )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {
            "step": 0,
            "momentum_buffer": np.zeros_like(param),
            "pending": np.zeros_like(param),
        }

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        delay = int(self.delay)
        state["step"] += 1
        pending, buf = state["pending"], state["momentum_buffer"]
        pending += grad
        param -= grad * t(self.lr / delay)
        if state["step"] % delay:
            return
        buf *= t(self.momentum)
        buf += pending * t(1.0 / delay)
        pending[...] = 0
        param -= buf * t(self.lr * self.momentum)


# The shard's optimizer registry takes these beside pscore.optim's (pscore/optspec.py).
OUTER_OPTIMIZERS: dict[str, type[Optimizer]] = {DelayedNesterov.name: DelayedNesterov}
