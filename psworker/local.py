"""``mode="local"``: one process, no network; the optimizer runs in place with the shards' math."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pswire.codec import check_tensor
from pswire.errors import ClientClosedError, NotInitializedError, not_in_model
from pswire.optim import Optimizer
from pswire.rowstore import RowStore
from pswire.tables import RowSparse, Table, as_ids, check_rows
from psworker.api import PushThenPull
from psworker.placement import TableLayout, check_out


class LocalClient(PushThenPull):
    """The ``Client`` role for a single worker: the reference every mode is tested against.

    Pushes are applied at once, like a one-worker ``sync`` job, with the same optimizer code the
    shards run.
    """

    mode = "local"
    staleness = 0
    worker_id = 0
    num_workers = 1
    addresses: list[str] = []

    def __init__(self) -> None:
        self.step = 0
        self._vars: dict[str, np.ndarray] = {}
        self._slots: dict[str, dict] = {}
        self._buffers: set[str] = set()
        self._optimizer: Optimizer | None = None
        self._tables: dict[str, tuple[TableLayout, RowStore]] = {}
        self._closed = False

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release; as every client, later calls raise ClientClosedError."""
        self._closed = True

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer,
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
    ) -> None:
        """Copies the starting values and creates the optimizer state; ``tables`` are made
        here with the shards' seeded rows (a fixed table in full, so it must fit).

        Raises:
            ClientClosedError: the client was closed.
        """
        self._require_open()
        self._tables = {}
        for name, table in (tables or {}).items():
            layout = TableLayout.build(name, table, 1)
            self._tables[name] = (layout, RowStore(layout.slice_for(0), optimizer))
        self._vars = {k: np.array(v, copy=True) for k, v in variables.items()}
        self._buffers = set(buffers)
        self._optimizer = optimizer
        self._slots = {
            k: optimizer.make_state(v) for k, v in self._vars.items() if k not in self._buffers
        }

    def pull(
        self, names: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Copies of the current values (into ``out``'s arrays where given, as
        ``PSClient.pull``).

        Raises:
            UnknownVariableError: a name not in the model.
            InvalidRequestError: an ``out`` array of the wrong shape or dtype, or read-only.
        """
        self._require_init()
        wanted = list(names) if names is not None else list(self._vars)
        for name in wanted:
            if name not in self._vars:
                raise not_in_model(name, self._vars)
        if not out:
            return {k: self._vars[k].copy() for k in wanted}
        check_out(out, {k: (self._vars[k].shape, self._vars[k].dtype.name) for k in wanted})
        for name, array in out.items():
            np.copyto(array, self._vars[name])
        return {k: out[k] if k in out else self._vars[k].copy() for k in wanted}

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Rows ``ids`` of a table, as ``PSClient.pull_rows``.

        Raises:
            UnknownVariableError, InvalidRequestError: as a shard would.
        """
        self._require_init()
        layout, store = self._table(table)
        flat = as_ids(table, ids)
        layout.check_ids(flat, "pull")
        return store.gather(flat)

    def push(self, grads: Mapping[str, np.ndarray | RowSparse], step: int | None = None) -> bool:
        """Applies one step's gradients (buffers: stores the values) at once.

        Raises:
            UnknownVariableError, InvalidRequestError: as a shard would; nothing changes then.
        """
        opt = self._require_init()
        step = self.step if step is None else step
        if step < self.step:
            return False  # already applied, as a shard acknowledges a retried push
        # Each table's (store, ids, rows), checked before anything is applied.
        rows: dict[str, tuple[RowStore, np.ndarray, np.ndarray]] = {}
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                layout, store = self._table(name)
                ids, values = as_ids(name, grad.ids), np.asarray(grad.values)
                layout.check_ids(ids, "push")
                check_rows(store.spec, ids, values, "push")
                rows[name] = store, ids, values
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                continue
            var = self._vars.get(name)
            if var is None:
                raise not_in_model(name, self._vars)
            check_tensor(name, var.shape, var.dtype.name, np.asarray(grad), "push")
        for store, ids, values in rows.values():
            store.apply(ids, values)
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                continue
            if name in self._buffers:
                np.copyto(self._vars[name], grad, casting="unsafe")
            else:
                opt.apply(self._vars[name], np.asarray(grad), self._slots[name])
        self.step = step + 1
        return True

    def heartbeat(self) -> None:
        """No servers to tell."""

    def status(self) -> list:
        return []

    def _table(self, name: str) -> tuple[TableLayout, RowStore]:
        found = self._tables.get(name)
        if found is None:
            raise not_in_model(name, self._tables, "table")
        return found

    def _require_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed: connect again")

    def _require_init(self) -> Optimizer:
        self._require_open()
        if self._optimizer is None:
            raise NotInitializedError("call client.init(variables, optimizer) before pull or push")
        return self._optimizer
