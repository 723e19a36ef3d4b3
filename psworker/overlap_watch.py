"""When ``overlap=True`` may send gradients from backward's hooks: the rules every overlap
(the shards' and the ring's) follows, written once.

Overlap sends a gradient before ``step()``, so it is only right for a script that leaves the
gradients as backward made them. ``GradWatch`` notes each gradient as backward's hook reaches
it; after one serial step it arms, or, when the script touched the gradients between
``backward()`` and ``step()`` (``clip_grad_norm_``, a GradScaler, a closure, several
``backward()`` per step), keeps the serial step for good, with a warning saying why. Once
armed, a gradient changed after it left is an error (``check_unchanged``), never a silently
different step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from pswire.errors import ConfigError

__all__ = ["GradWatch", "Overlap"]


class Overlap(Protocol):
    """What ``DistributedOptimizer`` asks of an overlap (``psworker.overlap.build_overlap``)."""

    @property
    def armed(self) -> bool: ...

    def step(self, grad_scaler: Any = None) -> bool:
        """An armed step's checks; True when the overlap ended the step itself, False when
        the serial step follows (and finishes what the hooks started)."""
        ...

    def observe(self, grads: Mapping[str, torch.Tensor], grad_scaler: Any, closure: Any) -> None:
        """After a serial step: arm, or keep the serial step (``GradWatch.observe``)."""
        ...

    def wait(self) -> None:
        """Lands whatever is still in flight."""
        ...

    def discard(self) -> None:
        """``zero_grad()`` came: raises when it comes between a backward whose gradients
        already left and ``step()`` (``GradWatch.dropped``)."""
        ...

    def hold(self, held: bool) -> None:
        """While held, serial steps do not arm overlap (``overlap="auto"``'s trial)."""
        ...

    def disarm(self) -> None:
        """Lands what is in flight; every later step is serial."""
        ...

    def agree(self, times: np.ndarray) -> np.ndarray:
        """The times ``overlap="auto"`` chooses from (psworker/overlap_trial.py)."""
        ...

    def close(self) -> None: ...


class GradWatch:
    """Which gradients backward reached this step, and how each stood then (its tensor and
    version); whether overlap is armed, or off for good. Touched by the training thread only
    (CPU autograd runs hooks in the thread that called ``backward()``)."""

    def __init__(self) -> None:
        self.armed = False
        self.off = False  # a serial step showed the script needs it: never armed
        self.held = False  # overlap="auto" still timing serial steps: judged, not armed
        self._fired: dict[str, tuple[int, int]] = {}  # name -> (id, version) when reached
        self._twice: set[str] = set()  # reached twice: a second backward accumulated into it

    def reached(self, name: str, grad: torch.Tensor | None) -> bool:
        """Notes that backward's hook reached ``name`` with ``grad``; whether overlap is armed
        (the caller then sends what this gradient completes)."""
        if self.off or grad is None:  # the hook fires after accumulating into .grad
            return False
        if name in self._fired:
            self._twice.add(name)
        self._fired[name] = (id(grad), grad._version)
        return self.armed

    def hook(
        self,
        params: Mapping[str, torch.nn.Parameter],
        on_reached: Callable[[str, torch.Tensor], None],
    ) -> None:
        """Registers backward's post-accumulate-grad hook on every parameter: each notes its
        gradient (``reached``) and, once armed, calls ``on_reached(name, grad)``. A frozen
        parameter (``requires_grad`` False) is hooked too, so a layer unfrozen later (fine-
        tuning) is waited for from its first step; torch hooks only a tensor that requires
        grad, so its flag is set for the call and put back."""

        def fired(name: str, param: torch.Tensor) -> None:
            grad = param.grad
            if self.reached(name, grad):
                assert grad is not None  # reached() is False without one
                on_reached(name, grad)

        for name, param in params.items():
            frozen = not param.requires_grad
            if frozen and not (param.is_floating_point() or param.is_complex()):
                continue  # no gradient, ever
            try:
                param.requires_grad_(True)
                param.register_post_accumulate_grad_hook(partial(fired, name))
            finally:
                if frozen:
                    param.requires_grad_(False)

    @staticmethod
    def trainable(params: Mapping[str, torch.nn.Parameter], names: Iterable[str]) -> set[str]:
        """Those of ``names`` whose gradient this backward makes (``requires_grad`` now: a
        layer frozen or unfrozen between steps is waited for, or not, from that step)."""
        return {n for n in names if (p := params.get(n)) is not None and p.requires_grad}

    def order(self) -> list[str]:
        """The gradients backward reached this step, in the order it first reached them."""
        return list(self._fired)

    def reset(self) -> None:
        """Forgets this step's gradients (a step ended)."""
        self._fired = {}
        self._twice = set()

    def observe(self, grads: Mapping[str, torch.Tensor], grad_scaler: Any, closure: Any) -> None:
        """After a serial step: arms when nothing touched the gradients between
        ``backward()`` and ``step()``; else keeps the serial step for good, saying why."""
        if self.off or self.armed:
            return
        reached = dict(self._fired)
        twice = sorted(self._twice)
        self.reset()
        if not reached:
            return  # no backward hook fired (gradients set by hand): judge the next step
        reasons = []
        if grad_scaler is not None:
            reasons.append("a GradScaler unscales and inf-checks every gradient in step()")
        if closure is not None:
            reasons.append("step(closure) runs backward inside step()")
        changed = sorted(
            n
            for n, g in grads.items()
            if n in reached and (id(g), g._version) != reached[n] and n not in twice
        )
        if changed and grad_scaler is None:
            reasons.append(
                f"gradients {changed[:3]} changed between backward() and step() "
                "(clip_grad_norm_?), which needs every gradient before any is sent"
            )
        if twice:
            reasons.append(f"gradients {twice[:3]} were accumulated by several backward() per step")
        if reasons:
            self.off = True
            warnings.warn(
                "DistributedOptimizer(overlap=True) keeps the serial step (pushes after "
                f"backward): {'; '.join(reasons)}",
                UserWarning,
                stacklevel=4,
            )
        elif not self.held:
            self.armed = True

    def disarm(self) -> None:
        """Every later step is serial (overlap="auto" found it faster); no warning."""
        self.armed = False
        self.off = True
        self.reset()

    @staticmethod
    def dropped() -> ConfigError:
        """The error for a step dropped after its gradients left from backward (a loss check
        after ``backward()`` that zeroes the gradients and skips ``step()``)."""
        return ConfigError(
            "zero_grad() after backward() and before step(): with overlap=True this step's "
            "gradients left during backward(), so the step cannot be dropped any more (a "
            "check of the loss after backward() that skips step()). Check the loss before "
            "backward() and skip both, or construct DistributedOptimizer(..., overlap=False)"
        )

    @staticmethod
    def refuse_scaler(grad_scaler: Any) -> None:
        """Raises when a GradScaler reaches an armed step.

        Raises:
            ValueError: ``grad_scaler`` is not None.
        """
        if grad_scaler is not None:
            raise ConfigError(
                "a GradScaler reached step() after overlap was armed: its unscale and "
                "inf-check need every gradient before any is sent; construct "
                "DistributedOptimizer(..., overlap=False) for AMP scripts"
            )

    def check_unchanged(
        self, sent: Iterable[str], grads: Mapping[str, torch.Tensor | None], holder: str
    ) -> None:
        """Raises when a gradient among ``sent`` changed since backward reached it (another
        tensor, an in-place change, a second backward, or gone).

        Raises:
            ValueError: naming the gradients, the likely cause, and what ``holder`` (the
                shards, the ring) holds instead.
        """
        changed = sorted(
            n
            for n in sent
            if n in self._twice
            or (g := grads.get(n)) is None
            or (id(g), g._version) != self._fired.get(n)
        )
        if changed:
            raise ConfigError(
                f"with overlap=True the gradients of {changed[:4]} changed after backward() "
                "had sent them (clip_grad_norm_, a GradScaler's unscale_, a second backward() "
                "accumulating into them on this step only, or a step() skipped after "
                f"backward()): {holder} the values "
                "backward left. Construct DistributedOptimizer(..., overlap=False) "
                "for a script that changes gradients before step()"
            )
