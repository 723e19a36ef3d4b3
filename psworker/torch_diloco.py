"""PyTorch side of local-step training (DiLoCo): ``DiLoCoOptimizer``, what
``DistributedOptimizer`` becomes over a ``DiLoCoClient`` (``psworker/diloco.py``).

The script's torch optimizer is the inner optimizer: it steps the model's own weights here;
every ``local_steps``-th step the outer step pushes the pseudo-gradients and loads the job's
new weights. The inner optimizer's state (AdamW's moments) persists across outer steps, as in
the paper.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pscore.optim import Optimizer
from pswire.errors import ConfigError, ModelMismatchError
from psworker.api import Elastic
from psworker.diloco import DiLoCoClient, Landed, OuterSteps
from psworker.diloco_resume import WorkerState
from psworker.reports import StepLog
from psworker.torch import (
    BUFFER_PREFIX,
    DistributedOptimizer,
    buffer_homes,
    raise_naming_fixed,
)
from psworker.torch_optim import torch_optimizer_for

log = logging.getLogger(__name__)


class DiLoCoOptimizer(DistributedOptimizer):
    """Trains ``model`` with local steps: ``step()`` is one inner step of ``optimizer`` (any
    torch optimizer, or a ``psworker.SGD``-style spec), and every ``local_steps``-th also the
    outer step. Worker 0's weights start every worker.

    ``param_groups`` and ``state`` are the inner optimizer's: schedulers and GradScaler work
    on it as on any torch optimizer (a step GradScaler skips is not counted). ``state_dict``
    is the inner optimizer's; the outer optimizer's state lives on the shards and in their
    checkpoints. Buffers (BatchNorm statistics) travel at outer steps beside the
    pseudo-gradients. ``writer``: as ``DistributedOptimizer``'s, per outer step.

    Raises (constructor):
        ValueError: an optimizer that is not a torch optimizer or spec, a parameter not in
            the model, or embedding tables (nothing was sent).
        PSError: the shards refuse the job (ModelMismatchError names a differing H, inner
            optimizer or model).
    """

    # GradScaler unscales the gradients and skips an inf/NaN step itself (as with any torch
    # optimizer): no step of ours is taken then, and none is counted.
    _step_supports_amp_scaling = False

    def __init__(
        self,
        model: torch.nn.Module,
        client: DiLoCoClient,
        optimizer: torch.optim.Optimizer | Optimizer,
        writer: Any = None,
    ) -> None:
        if isinstance(optimizer, Optimizer):
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch_optimizer_for(optimizer, trainable)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim optimizer or a psworker spec, got "
                f"{type(optimizer).__name__}"
            )
        self.model = model
        self.client = client
        self._diloco = client  # typed: the outer client, its state file
        self._inner = optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._tables = {}  # none in this mode (DiLoCoClient.init refuses them)
        self._prefix = ""
        self._together = 1
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    raise ConfigError(
                        f"parameter group {index} of {type(optimizer).__name__} holds a tensor "
                        f"of shape {tuple(p.shape)} that is not a parameter of the model"
                    )
                self._params[name] = p
        self._buffers = {BUFFER_PREFIX + n: b for n, b in model.named_buffers() if b is not None}
        self._buffer_homes = buffer_homes(model, self._buffers)
        self._log = StepLog(client, writer)
        client.declare(describe(optimizer))
        with torch.no_grad():
            values = {n: _host(t) for n, t in {**self._params, **self._buffers}.items()}
            fixed = {n: a for n, (_, a) in self._fixed().items()}
            try:
                client.init(values, buffers=list(self._buffers), fixed=fixed)
                weights = client.pull()
            except ModelMismatchError as exc:
                raise_naming_fixed(exc, fixed)
            self._load(weights)
        in_model_order = [n for n, _ in model.named_parameters() if n in self._params]
        self._steps = OuterSteps(client, weights, list(self._buffers), order=in_model_order)
        # torch's Optimizer, not DistributedOptimizer's constructor (which pushes gradients).
        torch.optim.Optimizer.__init__(
            self, [{"params": g["params"]} for g in optimizer.param_groups], {}
        )
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        if client.state_file is not None:
            self._resume(client.state_file)

    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None
    ) -> Any:
        """One inner step; every ``local_steps``-th also the outer step (push the
        pseudo-gradients, load the job's new weights: in sync mode once every live worker's
        are applied); with fragments, a fragment's outer step every ``local_steps /
        fragments``-th, its new weights landing ``overlap_steps`` inner steps later.

        Raises:
            PSError: the outer step's push or pull failed.
        """
        loss = self._inner.step(closure)
        if self._steps.inner_step():
            self._outer(self._steps.outer_step)
        return loss

    def synchronize(self) -> None:
        """Takes the outer step now for the inner steps since the last one (none: nothing),
        of every fragment, once an exchange still in flight has landed: what a script calls
        when it stops training between outer steps (its last steps would otherwise never reach
        the job), e.g. with dynamic local steps, whose outer steps fall where each worker's
        pace puts them, or with fragments or overlap. With synchronous outer steps every
        worker must call it at the same inner step, as every outer step is taken.

        Raises:
            PSError: the outer step's push or pull failed.
        """
        self._outer(self._steps.flush)

    @property
    def local_steps(self) -> int:
        """The inner steps between outer steps (``local_steps / fragments``; with dynamic
        local steps, this worker's share as its pace sets it)."""
        return self._steps.due

    def _outer(
        self,
        take: Callable[
            [Callable[[Sequence[str]], Mapping[str, np.ndarray]]],
            tuple[dict[str, np.ndarray], list[Landed]],
        ],
    ) -> None:
        self._adopt_buffers()  # each inner forward may have replaced one (read, then loaded)
        with torch.no_grad():
            loads, landed = take(self._read)
            self._load(loads)
        state_file = self._diloco.state_file
        if state_file is not None and landed and not self._steps.in_flight:
            self._save(state_file)
        if self._log.active:
            for one in landed:
                self._log.step(one.step, one.seconds, one.sent, one.received)

    def _read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        tensors = {**self._params, **self._buffers}
        return {n: _host(tensors[n]) for n in names}

    def _save(self, path: Path) -> None:
        """Writes this worker's own state (``psworker/diloco_resume.py``)."""
        rng, cuda_rng = WorkerState.generators()
        tensors = {**self._params, **self._buffers}
        WorkerState(
            job=self._diloco.outer.identity.value,
            worker=self.client.worker_id,
            outer_step=self._steps.outer_step_count,
            inner_step=self.client.step,
            done=self._steps.done,
            model={n: t.detach().cpu() for n, t in tensors.items()},
            inner=self._inner.state_dict(),
            rng=rng,
            cuda_rng=cuda_rng,
        ).save(path)

    def _resume(self, path: Path) -> None:
        """Loads this worker's own state from ``path`` when it resumes this job (see
        ``WorkerState.check_resumable``).

        Raises:
            ConfigError: a state of this job that cannot resume it (named).
        """
        saved = WorkerState.load(path)
        outer = self._diloco.outer
        if saved is None or not saved.check_resumable(
            outer.identity.value, self.client.worker_id, outer.step, isinstance(outer, Elastic)
        ):
            return
        tensors = {**self._params, **self._buffers}
        if set(saved.model) != set(tensors):
            raise ConfigError(
                f"{path} holds the variables {sorted(saved.model)}, the model "
                f"{sorted(tensors)}: another model's state"
            )
        with torch.no_grad():
            for name, value in saved.model.items():
                tensors[name].copy_(value.to(tensors[name].device))
        self.load_state_dict(saved.inner)
        saved.restore_generators()
        self._steps.resume(saved.outer_step, saved.done, saved.inner_step)
        log.info(
            "worker %d resumed from its DiLoCo state at outer step %d, inner step %d (%s)",
            self.client.worker_id,
            saved.outer_step,
            saved.inner_step,
            path,
        )

    def report(self, **values: Any) -> None:
        """As ``DistributedOptimizer.report``."""
        if self._log.active:
            self._log.report(values)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict (the outer state is in the shards' checkpoints)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the inner optimizer's state_dict."""
        self._inner.load_state_dict(state_dict)
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state

    def _load(self, weights: dict[str, np.ndarray]) -> None:
        """Copies ``weights`` (some or all variables) into the model."""
        tensors = {**self._params, **self._buffers}
        for name, value in weights.items():
            array = np.require(value, requirements="W")  # torch wants a writable one
            tensors[name].copy_(torch.from_numpy(array).to(tensors[name].device))


def describe(optimizer: torch.optim.Optimizer) -> str:
    """The inner optimizer's class and each group's hyper-parameters (what every worker must
    share), in a stable text form."""
    groups = []
    for group in optimizer.param_groups:
        values = {k: v for k, v in sorted(group.items()) if k != "params"}
        shown = ", ".join(f"{k}={v}" for k, v in values.items() if _plain(v))
        groups.append(f"{{{shown}}}")
    return f"{type(optimizer).__name__}[{', '.join(groups)}]"


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str | tuple)


def _host(tensor: torch.Tensor) -> np.ndarray:
    return np.array(tensor.detach().cpu().numpy(), copy=True)
