"""PyTorch integration: a DistributedOptimizer that trains a module through any client mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pswire.optim import Optimizer
from psworker.allreduce import AllReduceClient
from psworker.client import PSClient
from psworker.local import LocalClient

BUFFER_PREFIX = "buffer:"


class _HostStaging:
    """Reusable host buffers between a device tensor and the wire.

    For CUDA tensors the buffers are pinned, filled and drained with non-blocking copies, and
    allocated once: no per-step allocation. For CPU tensors no staging is needed and numpy views
    share the tensors' memory.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], pin: bool) -> None:
        self.pin = pin
        self.out: dict[str, torch.Tensor] = {}  # device -> wire (gradients, buffer values)
        self.into: dict[str, torch.Tensor] = {}  # wire -> device (weights)
        if pin:
            for name, t in tensors.items():
                self.out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self.into[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._landed: Any = None  # CUDA event: last host->device copy finished reading `into`

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """numpy views of ``tensors`` on the host (after one non-blocking copy if on a GPU)."""
        if not self.pin:
            return {n: t.detach().contiguous().numpy() for n, t in tensors.items()}
        for name, t in tensors.items():
            self.out[name].copy_(t.detach(), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return {n: self.out[n].numpy() for n in tensors}

    def to_device(self, arrays: dict[str, np.ndarray], targets: dict[str, torch.Tensor]) -> None:
        """Copies host arrays into device tensors (non-blocking from pinned memory on a GPU)."""
        if not self.pin:
            for name, array in arrays.items():
                # A numpy view of the CPU tensor: one copy, and no tensor over a read-only array.
                np.copyto(targets[name].detach().numpy(), array)
            return
        if self._landed is not None:
            self._landed.synchronize()  # the previous copy still reads these buffers
        with torch.no_grad():
            for name, array in arrays.items():
                staged = self.into[name]
                np.copyto(staged.numpy(), array)
                targets[name].copy_(staged, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()


class DistributedOptimizer:
    """Trains ``model`` through ``client``: ``step()`` pushes gradients and loads fresh weights.

    On construction it registers ``model.named_parameters()`` with the client; worker 0's
    weights become every worker's starting point, and are loaded into the model, so replicas
    start identical. ``optimizer`` (``psworker.SGD``/``Adam``/``Adagrad``) runs on the shards
    in parameter-server modes and in this process in ``local`` mode, with the same math.

    Gradients that are ``None`` (parameters unused this step) are not sent: the shards do not
    update those parameters from this worker (in ``sync`` the step's average counts them as
    zero from this worker). Buffers (e.g. BatchNorm running statistics) travel beside the
    gradients: after each step every worker holds the shards' copy, which in ``sync`` mode is
    the mean over workers and otherwise the latest pushed, so replicas stay consistent.

    Raises (constructor):
        ValueError: a parameter that is not floating point.
        PSError: the shards reject the model (e.g. ModelMismatchError).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        client: PSClient | LocalClient | AllReduceClient,
        optimizer: Optimizer,
    ) -> None:
        self.model = model
        self.client = client
        self.optimizer = optimizer
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for name, p in self._params.items():
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter '{name}' has dtype {p.dtype}; expected floating point")
        self._buffers = {BUFFER_PREFIX + n: b for n, b in model.named_buffers() if b is not None}
        everything = {**self._params, **self._buffers}
        on_gpu = any(t.is_cuda for t in everything.values())
        self._staging = _HostStaging(everything, pin=on_gpu)
        with torch.no_grad():
            initial = self._staging.to_host(everything)
            client.init(
                {n: np.array(a, copy=True) for n, a in initial.items()},
                optimizer,
                buffers=list(self._buffers),
            )
            self._staging.to_device(client.pull(), everything)

    @property
    def step_count(self) -> int:
        return self.client.step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients, as ``torch.optim.Optimizer.zero_grad`` does."""
        for p in self._params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def step(self) -> None:
        """Pushes this worker's gradients (and buffers), then loads the weights the mode allows.

        ``sync`` waits until every worker's gradient for this step is applied; ``ssp`` waits
        only while a worker is more than ``staleness`` steps behind; ``async`` never waits.

        Raises:
            PSError: the push or pull failed (e.g. WaitTimeoutError naming the late workers).
        """
        grads = {n: p.grad for n, p in self._params.items() if p.grad is not None}
        outgoing = self._staging.to_host({**grads, **self._buffers})
        self.client.push(outgoing)
        self._staging.to_device(self.client.pull(), {**self._params, **self._buffers})

    def state_dict(self) -> dict[str, Any]:
        """The worker-side state: step, mode and hyper-parameters (optimizer slots live on the
        shards in parameter-server modes and are checkpointed there)."""
        return {
            "step": self.client.step,
            "mode": self.client.mode,
            "optimizer": {"name": self.optimizer.name, **self.optimizer.params()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the step counter saved by ``state_dict``.

        Raises:
            ValueError: the saved optimizer differs from this one.
        """
        saved = state.get("optimizer", {})
        mine = {"name": self.optimizer.name, **self.optimizer.params()}
        if saved and saved != mine:
            raise ValueError(f"state_dict is for optimizer {saved}, this one is {mine}")
        self.client.step = int(state["step"])

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from self._params.values()
