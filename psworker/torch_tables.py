"""Embedding tables that live on the parameter-server shards: ``Embedding``, ``EmbeddingBag``."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pscore.tables import RowSparse, Table
from pswire.errors import ConfigError
from psworker.api import Client

# The zero-element parameter standing for a table in model.parameters(): whichever parameter
# group of a torch optimizer holds it is the table's group (e.g. one without weight decay).
HANDLE = "handle"


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
        init_from: str = "",
        device: torch.device | str | None = None,
        padding_idx: int | None = None,
        scale_grad_by_freq: bool = False,
    ) -> None:
        super().__init__()
        self.table = Table(
            num_embeddings, embedding_dim, "float32", init, init_scale, seed, capacity, init_from
        )
        if padding_idx is not None and (
            isinstance(padding_idx, bool)
            or not isinstance(padding_idx, int | np.integer)
            or not -(2**63) <= padding_idx < 2**63
        ):
            raise ConfigError(
                f"table '{name}': padding_idx must be an int64 id, got {padding_idx!r}"
            )
        if padding_idx is not None and num_embeddings is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigError(
                    f"table '{name}': padding_idx {padding_idx} is outside its "
                    f"{num_embeddings} rows"
                )
            padding_idx %= num_embeddings  # as torch: -1 is the last row
        self.padding_idx = padding_idx
        self.scale_grad_by_freq = scale_grad_by_freq
        self.client = client
        self.name = name
        self.device = torch.device(device or "cpu")
        self._pending: list[_Gathered] = []  # the forwards since the last step
        self._ahead: np.ndarray | None = None  # the next batch's distinct ids (prefetch)
        self._ready: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) fetched
        # Stands for the table in parameter groups; never trained, never in state_dict.
        self.handle = torch.nn.Parameter(torch.zeros(0, device=self.device))

    def __getstate__(self) -> Any:
        """Refused: a copy (``copy.deepcopy(model)``, ``AveragedModel``) or a pickle
        (``torch.save(model)``) cannot hold the rows, which live on the shards.

        Raises:
            ValueError: always, naming the table.
        """
        raise ConfigError(
            f"table '{self.name}' lives on the shards: a copy or a pickle of the model holding "
            "it (copy.deepcopy, AveragedModel, torch.save(model)) cannot hold its rows. Save "
            "model.state_dict() (the dense weights; the rows are in psctl export and the "
            "shards' checkpoints), and make a second model with its own table name for a "
            "copy of its own"
        )

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        pass  # the rows live on the shards (psctl checkpoint); the handle holds nothing

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        state_dict.pop(prefix + HANDLE, None)  # saved by an earlier build: nothing to load

    def extra_repr(self) -> str:
        t = self.table
        rows = "dynamic" if t.num_rows is None else t.num_rows
        return (
            f"'{self.name}', {rows}, {t.dim}"
            + (f", capacity={t.capacity}" if t.capacity else "")
            + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
        )

    def prefetch(self, input: torch.Tensor) -> None:
        """Asks for the rows of ``input`` (the next batch's ids, which the data loader knows)
        with the next ``DistributedOptimizer.step()``: its push then brings them back in the
        same round trip, read after the push as a pull at the next step would read them, and
        the next forward of exactly these ids uses them instead of pulling. A forward of other
        ids pulls as usual.

        Raises:
            TypeError: ids that are not integers.
        """
        self._ahead = np.unique(self._ids(input))

    def take_prefetch(self) -> np.ndarray | None:
        """The ids ``prefetch`` asked for (None: none), forgotten: the step carries them."""
        ahead, self._ahead = self._ahead, None
        return ahead

    def prefetched(self, ids: np.ndarray | None, rows: np.ndarray | None) -> None:
        """The rows a step brought back for ``ids`` (None: none), for the next forward."""
        self._ready = None if ids is None or rows is None else (ids, rows)

    def _ids(self, input: torch.Tensor) -> np.ndarray:
        if input.dtype.is_floating_point or input.dtype.is_complex:
            raise TypeError(f"table '{self.name}' takes integer ids, got {input.dtype}")
        return input.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)

    def _rows(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(the batch's distinct rows, pulled or prefetched; each input position's index
        into them; the padding id's index, None where the batch has none). The padding row
        reads as zeros, as torch starts it, unless it came from ``init_from`` (as torch's
        ``from_pretrained`` keeps it); the forward gives it no gradient, as torch's."""
        unique, inverse = np.unique(self._ids(input), return_inverse=True)
        ready, self._ready = self._ready, None  # rows of one step serve one forward
        if ready is not None and np.array_equal(ready[0], unique):
            pulled = ready[1]
        else:
            pulled = self.client.pull_rows(self.name, unique)
        rows = torch.from_numpy(pulled).to(self.device)
        pad = None
        if self.padding_idx is not None:
            at = int(np.searchsorted(unique, self.padding_idx))
            if at < len(unique) and unique[at] == self.padding_idx:
                pad = at
                if not self.table.init_from:
                    rows = rows.clone()
                    rows[at] = 0
        if torch.is_grad_enabled() and self.handle.requires_grad:  # frozen: no gradient
            rows.requires_grad_(True)
            gathered = _Gathered(unique, weakref.ref(rows))
            # Weakly: the hooks live on the rows, which live as long as a graph reaching them.
            entry = weakref.ref(gathered)
            rows.register_hook(functools.partial(_backward_reached, self.handle, entry))
            rows.register_post_accumulate_grad_hook(functools.partial(_accumulated, entry))
            # Forwards no backward can reach any more (an evaluation without no_grad(), its
            # loss dropped) hold nothing: forgotten, so such a loop holds no rows.
            self._pending = [g for g in self._pending if not g.dead()]
            self._pending.append(gathered)
        index = torch.from_numpy(inverse.reshape(input.shape)).to(self.device)
        return rows, index, pad

    def take_grads(self) -> RowSparse | None:
        """The row-sparse gradient of every forward since the last call (None: no rows got
        a gradient); forgets those forwards."""
        now = self.handle.grad
        parts = [g for g in self._pending if g.current(now)]
        self._pending = []
        if not parts:
            return None
        ids = np.concatenate([g.ids for g in parts])
        grads = [g.grad for g in parts]  # none is None: current()
        values = np.concatenate([t.detach().cpu().numpy() for t in grads if t is not None])
        return RowSparse(ids, values)

    def zero_row_grads(self) -> None:
        """Drops the row gradients of the forwards since the last step, as ``zero_grad`` does a
        parameter's, by the one rule ``model.zero_grad()`` goes through (the handle's gradient
        set to None; see ``_backward_reached``), whatever ``set_to_none``. The forwards stay: a
        backward still to come (a loop that calls ``zero_grad`` between forward and backward)
        fills their rows' gradients again."""
        self.handle.grad = None


@dataclass
class _Gathered:
    """One forward's distinct rows of a table (alive as long as a graph that reaches them:
    held weakly), their gradient once a backward reached them, and the handle gradient that
    backward saw."""

    ids: np.ndarray
    rows: weakref.ref[torch.Tensor]
    since: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    def current(self, handle_grad: torch.Tensor | None) -> bool:
        """Whether these rows hold a gradient no zero_grad has cleared since."""
        return self.grad is not None and handle_grad is not None and self.since is handle_grad

    def dead(self) -> bool:
        """Whether no backward reached these rows and none can any more (no graph does)."""
        return self.grad is None and self.rows() is None


def _backward_reached(
    handle: torch.Tensor, entry: weakref.ref[_Gathered], grad: torch.Tensor
) -> None:
    """A backward reached an entry's rows, whose gradient is about to accumulate.

    ``model.zero_grad()`` (the module's, which never sees the rows) sets the table handle's
    gradient to None, as any parameter's. So the handle gets an empty gradient here when it
    has none, and the rows belong to it: rows whose gradient belongs to an older one were
    zeroed since, and drop it before this one accumulates; at step only rows of the handle's
    current gradient count (none after a zero_grad that no backward followed).
    """
    gathered = entry()
    if gathered is None:  # stepped already: a backward through an old graph counts nowhere
        return
    now = handle.grad
    if now is None:
        now = handle.grad = torch.zeros(0, device=handle.device)
    if gathered.since is not now:
        rows = gathered.rows()
        if rows is not None:  # it is: this backward reaches it
            rows.grad = None
        gathered.grad = None
        gathered.since = now


def _accumulated(entry: weakref.ref[_Gathered], rows: torch.Tensor) -> None:
    """A backward's gradient accumulated into an entry's rows: the entry keeps it (the rows
    go once no graph reaches them)."""
    gathered = entry()
    if gathered is not None:
        gathered.grad = rows.grad


class Embedding(_RemoteTable):
    """``torch.nn.Embedding`` whose table lives on the parameter-server shards.

    ``num_embeddings`` None makes a dynamic table (any int64 id, such as a feature hash; rows
    are created on first touch, ``capacity`` bounds each shard's rows with LRU eviction).
    Each forward pulls only the distinct ids of its batch; backward gives those rows'
    gradient, which ``DistributedOptimizer.step()`` pushes as a ``RowSparse``: no worker ever
    holds the table. Rows start as N(0, init_scale**2) (``init="normal"``, scale 1 as in
    torch), ``"uniform"`` or ``"zeros"``, drawn from ``(seed, id)``; or from a file each
    shard reads (``init_from``: a ``.safetensors`` file with the table under ``name``, and a
    dynamic table's ids under ``name + ".ids"`` and the rows' optimizer state beside them,
    as ``psctl export`` writes it; or, for a fixed table, a ``.npy`` array).

    ``padding_idx`` as torch's: that id's row reads as zeros (torch starts it as zeros; from
    an ``init_from`` file, the file's row, as ``from_pretrained`` keeps it) and gets no
    gradient, so it never trains. For a fixed table a negative one counts from the end; for
    a dynamic table it is any int64 id. ``scale_grad_by_freq`` as torch's: each row's
    gradient divided by how often the batch holds its id.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, index, pad = self._rows(input)
        return torch.nn.functional.embedding(
            index, rows, padding_idx=pad, scale_grad_by_freq=self.scale_grad_by_freq
        )


class EmbeddingBag(_RemoteTable):
    """``torch.nn.EmbeddingBag`` (``mode`` "sum" or "mean") over a table on the shards: a 2-d
    input is one bag per row; a 1-d input needs ``offsets``, as in torch. ``padding_idx``
    (as ``Embedding``'s): that id is left out of its bag's sum and mean, as in torch."""

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
        rows, index, pad = self._rows(input)
        return torch.nn.functional.embedding_bag(
            index,
            rows,
            offsets.to(self.device) if offsets is not None else None,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            padding_idx=pad,
            scale_grad_by_freq=self.scale_grad_by_freq,
        )


def _tables_of(model: torch.nn.Module, client: Client) -> dict[str, _RemoteTable]:
    """The model's shard-held tables by name.

    Raises:
        ValueError: two tables share a name, or a table uses another client.
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
