"""Host staging between a model's tensors and the wire: numpy views of CPU tensors, or reusable
pinned buffers filled and drained with non-blocking copies for CUDA tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class HostStaging:
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
        """numpy views of ``tensors`` on the host (after one non-blocking copy if on a GPU).
        A sparse gradient (``nn.Embedding(sparse=True)``) is made dense: the same math as
        torch's sparse SGD and Adagrad, whose untouched rows see a zero gradient."""
        if not self.pin:
            return {n: _dense(t).contiguous().numpy() for n, t in tensors.items()}
        for name, t in tensors.items():
            self.out[name].copy_(_dense(t), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return {n: self.out[n].numpy() for n in tensors}

    def receivers(self, targets: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Host arrays a pull may decode the weights of ``targets`` straight into: the CPU
        tensors' own memory, or the pinned buffers (once the last copy out of them is done).
        Tensors numpy cannot view (e.g. bfloat16) are left out."""
        if self.pin:
            if self._landed is not None:
                self._landed.synchronize()  # the previous copy still reads these buffers
                self._landed = None
            return {n: self.into[n].numpy() for n in targets}
        out = {}
        for name, t in targets.items():
            try:
                out[name] = t.detach().numpy()
            except (TypeError, RuntimeError):
                continue
        return out

    def to_device(self, arrays: dict[str, np.ndarray], targets: dict[str, torch.Tensor]) -> None:
        """Copies host arrays into device tensors (non-blocking from pinned memory on a GPU);
        arrays a pull already decoded into place (``receivers``) are not copied again."""
        if not self.pin:
            for name, array in arrays.items():
                # A numpy view of the CPU tensor: one copy, and no tensor over a read-only array.
                view = targets[name].detach().numpy()
                if not np.may_share_memory(view, array):
                    np.copyto(view, array)
            return
        if self._landed is not None:
            self._landed.synchronize()  # the previous copy still reads these buffers
        with torch.no_grad():
            for name, array in arrays.items():
                staged = self.into[name]
                if not np.may_share_memory(staged.numpy(), array):
                    np.copyto(staged.numpy(), array)
                targets[name].copy_(staged, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.to_dense() if tensor.is_sparse else tensor
