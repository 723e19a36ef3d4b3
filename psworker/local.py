"""``mode="local"``: one process, no network; the optimizer runs in place with the shards' math."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pswire.codec import check_tensor
from pswire.errors import (
    ClientClosedError,
    InvalidRequestError,
    NotInitializedError,
    StepRefusedError,
    not_in_model,
)
from pswire.optim import Optimizer
from pswire.optspec import StepOptions, group_optimizers, resolve_groups
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
        self.last_skipped = False  # the step last pushed had no optimizer update
        self._vars: dict[str, np.ndarray] = {}
        self._slots: dict[str, dict] = {}
        self._buffers: set[str] = set()
        self._optimizers: tuple[Optimizer, ...] = ()  # one per parameter group
        self._group: dict[str, int] = {}  # variable or table -> its group
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
        optimizer: Optimizer | Sequence[Optimizer],
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
    ) -> None:
        """Copies the starting values and creates the optimizer state; ``tables`` are made
        here with the shards' seeded rows (a fixed table in full, so it must fit).
        ``optimizer`` and ``groups`` as ``PSClient.init``.

        Raises:
            InvalidRequestError: bad parameter groups.
            ClientClosedError: the client was closed.
        """
        self._require_open()
        tables = tables or {}
        optimizers, group = resolve_groups(optimizer, groups, [*variables, *tables])
        self._tables = {}
        for name, table in tables.items():
            layout = TableLayout.build(name, table, 1)
            store = RowStore(layout.slice_for(0), optimizers[group[name]])
            self._tables[name] = (layout, store)
        self._vars = {k: np.array(v, copy=True) for k, v in variables.items()}
        self._buffers = set(buffers)
        self._optimizers, self._group = optimizers, group
        self._slots = {
            k: optimizers[group[k]].make_state(v)
            for k, v in self._vars.items()
            if k not in self._buffers
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

    def push(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        options: StepOptions | None = None,
    ) -> bool:
        """Applies one step's gradients (buffers: stores the values) at once, with
        ``options``' hyper-parameters; a skip (``options.skip``) stores buffers only.

        Raises:
            UnknownVariableError, InvalidRequestError: as a shard would; nothing changes then.
        """
        self._require_init()
        optimizers = group_optimizers(self._optimizers, options)
        skip = bool(options and options.skip)
        for name, opt in self._table_optimizers(optimizers).items():
            self._tables[name][1].spec.check(opt)
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
        for name, (store, ids, values) in rows.items():
            if not skip and not store.apply(ids, values, optimizers[self._group[name]]):
                raise StepRefusedError(
                    f"the optimizer step made table '{name}' non-finite (rows or optimizer "
                    "state overflowed); its rows were left as before"
                )
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                continue
            if name in self._buffers:
                np.copyto(self._vars[name], grad, casting="unsafe")
            elif not skip:
                opt = optimizers[self._group[name]]
                opt.apply(self._vars[name], np.asarray(grad), self._slots[name])
        self.step = step + 1
        self.last_skipped = skip
        return True

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Copies of every trained variable's optimizer slots (slots not made yet left out)."""
        self._require_init()
        return {
            k: {
                n: v.copy() if isinstance(v, np.ndarray) else v
                for n, v in s.items()
                if v is not None
            }
            for k, s in self._slots.items()
        }

    def load_state(
        self,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        digest: str = "",
    ) -> None:
        """``values`` and optimizer ``slots`` replace the current ones (a trained variable
        left out of ``slots`` starts its optimizer state afresh), as ``PSClient.load_state``.

        Raises:
            UnknownVariableError, InvalidRequestError: a bad state; nothing changed then.
        """
        self._require_init()
        self._slots = self._loaded_slots(values or {}, slots)
        for name, value in (values or {}).items():
            np.copyto(self._vars[name], value, casting="unsafe")

    def _loaded_slots(
        self, values: Mapping[str, np.ndarray], slots: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, dict]:
        """Every trained variable's slots after a load, checked (nothing is changed here).

        Raises:
            UnknownVariableError, InvalidRequestError: as ``load_state``.
        """
        for name, value in values.items():
            var = self._vars.get(name)
            if var is None:
                raise not_in_model(name, self._vars)
            check_tensor(name, var.shape, var.dtype.name, np.asarray(value), "loaded value")
        for name in slots:
            if name not in self._slots:
                raise not_in_model(name, self._slots, "trained variable")
        out = {}
        for name, var in self._vars.items():
            if name in self._buffers:
                continue
            opt = self._optimizers[self._group[name]]
            fresh = opt.make_state(var)
            for slot, value in slots.get(name, {}).items():
                if slot not in fresh:
                    raise InvalidRequestError(
                        f"optimizer state of '{name}' has slot '{slot}'; {opt.name} keeps "
                        f"{sorted(fresh)}"
                    )
                if isinstance(fresh[slot], int):
                    fresh[slot] = int(value)
                else:
                    check_tensor(f"{name}:{slot}", var.shape, var.dtype.name, value, "loaded slot")
                    fresh[slot] = np.array(value, dtype=var.dtype, copy=True)
            out[name] = fresh
        return out

    def _table_optimizers(self, optimizers: tuple[Optimizer, ...]) -> dict[str, Optimizer]:
        """The tables whose group's optimizer differs from the one they were made with."""
        return {
            n: optimizers[self._group[n]]
            for n in self._tables
            if optimizers[self._group[n]] is not self._optimizers[self._group[n]]
        }

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

    def _require_init(self) -> None:
        self._require_open()
        if not self._optimizers:
            raise NotInitializedError("call client.init(variables, optimizer) before pull or push")
