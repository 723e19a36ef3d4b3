"""PyTorch integration: a DistributedOptimizer that trains a module through any client mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pswire.errors import ConfigError
from pswire.optim import Optimizer
from pswire.tables import RowSparse, Table
from psworker.api import Client

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


class _RemoteTable(torch.nn.Module):
    """An embedding table that lives on the shards: a forward pulls only the batch's rows."""

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        client: Client,
        name: str,
        *,
        init: str = "normal",
        init_scale: float = 1.0,
        seed: int = 0,
        capacity: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.table = Table(
            num_embeddings, embedding_dim, "float32", init, init_scale, seed, capacity
        )
        self.client = client
        self.name = name
        self.device = torch.device(device or "cpu")
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []

    def extra_repr(self) -> str:
        t = self.table
        rows = "dynamic" if t.num_rows is None else t.num_rows
        return f"'{self.name}', {rows}, {t.dim}" + (
            f", capacity={t.capacity}" if t.capacity else ""
        )

    def _rows(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch's distinct rows, pulled; each input position's index into them)."""
        if input.dtype.is_floating_point or input.dtype.is_complex:
            raise TypeError(f"table '{self.name}' takes integer ids, got {input.dtype}")
        ids = input.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
        unique, inverse = np.unique(ids, return_inverse=True)
        rows = torch.from_numpy(self.client.pull_rows(self.name, unique)).to(self.device)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._pending.append((unique, rows))
        index = torch.from_numpy(inverse.reshape(input.shape)).to(self.device)
        return rows, index

    def take_grads(self) -> RowSparse | None:
        """The row-sparse gradient of every forward since the last call (None: no rows got
        a gradient); forgets those forwards."""
        parts = [(ids, rows.grad) for ids, rows in self._pending if rows.grad is not None]
        self._pending = []
        if not parts:
            return None
        ids = np.concatenate([p[0] for p in parts])
        values = np.concatenate([g.detach().cpu().numpy() for _, g in parts])
        return RowSparse(ids, values)

    def forget(self) -> None:
        self._pending = []


class Embedding(_RemoteTable):
    """``torch.nn.Embedding`` whose table lives on the parameter-server shards.

    ``num_embeddings`` None makes a dynamic table (any int64 id, such as a feature hash; rows
    are created on first touch, ``capacity`` bounds each shard's rows with LRU eviction).
    Each forward pulls only the distinct ids of its batch; backward gives those rows'
    gradient, which ``DistributedOptimizer.step()`` pushes as a ``RowSparse``: no worker ever
    holds the table. Rows start as N(0, init_scale**2) (``init="normal"``, scale 1 as in
    torch), ``"uniform"`` or ``"zeros"``, drawn from ``(seed, id)``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, index = self._rows(input)
        return torch.nn.functional.embedding(index, rows)


class EmbeddingBag(_RemoteTable):
    """``torch.nn.EmbeddingBag`` (``mode`` "sum" or "mean") over a table on the shards: a 2-d
    input is one bag per row; a 1-d input needs ``offsets``, as in torch."""

    def __init__(self, *args: Any, mode: str = "mean", **kwargs: Any) -> None:
        if mode not in ("sum", "mean"):
            raise ConfigError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(*args, **kwargs)
        self.mode = mode

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, index = self._rows(input)
        return torch.nn.functional.embedding_bag(
            index,
            rows,
            offsets.to(self.device) if offsets is not None else None,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
        )


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
        ConfigError: a parameter that is not floating point.
        PSError: the shards reject the model (e.g. ModelMismatchError).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        client: Client,
        optimizer: Optimizer,
    ) -> None:
        self.model = model
        self.client = client
        self.optimizer = optimizer
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for name, p in self._params.items():
            if not p.dtype.is_floating_point:
                raise ConfigError(
                    f"parameter '{name}' has dtype {p.dtype}; expected floating point"
                )
        self._buffers = {BUFFER_PREFIX + n: b for n, b in model.named_buffers() if b is not None}
        self._tables = _tables_of(model, client)
        everything = {**self._params, **self._buffers}
        on_gpu = any(t.is_cuda for t in everything.values())
        self._staging = _HostStaging(everything, pin=on_gpu)
        with torch.no_grad():
            initial = self._staging.to_host(everything)
            values = {n: np.array(a, copy=True) for n, a in initial.items()}
            tables = {name: m.table for name, m in self._tables.items()}
            client.init(values, optimizer, buffers=list(self._buffers), tables=tables)
            self._staging.to_device(client.pull(), everything)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients, as ``torch.optim.Optimizer.zero_grad`` does."""
        for table in self._tables.values():
            table.forget()
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
        # A table untouched this step is left out: it counts as zero, like a None grad.
        rows = {n: g for n, t in self._tables.items() if (g := t.take_grads()) is not None}
        targets = {**self._params, **self._buffers}
        # One round trip per shard per step, decoded straight into the model (or its pinned
        # staging): no second copy.
        out = self._staging.receivers(targets)
        weights = self.client.push_pull({**outgoing, **rows}, out=out)
        self._staging.to_device(weights, targets)

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
            ConfigError: the saved optimizer differs from this one.
        """
        saved = state.get("optimizer", {})
        mine = {"name": self.optimizer.name, **self.optimizer.params()}
        if saved and saved != mine:
            raise ConfigError(f"state_dict is for optimizer {saved}, this one is {mine}")
        self.client.step = int(state["step"])

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from self._params.values()


def _tables_of(model: torch.nn.Module, client: Client) -> dict[str, _RemoteTable]:
    """The model's shard-held tables by name.

    Raises:
        ConfigError: two tables share a name, or a table uses another client.
    """
    tables: dict[str, _RemoteTable] = {}
    for module in model.modules():
        if not isinstance(module, _RemoteTable):
            continue
        if module.name in tables and tables[module.name] is not module:
            raise ConfigError(f"two embedding tables are named '{module.name}'")
        if module.client is not client:
            raise ConfigError(f"table '{module.name}' was made with another client")
        tables[module.name] = module
    return tables
