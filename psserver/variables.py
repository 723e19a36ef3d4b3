"""A shard's model state: its dense variables, their optimizer slots and its table rows.

Plain data with the optimizer step; no locking (the shard's lock guards every call) and no
rule about when anything happens (the shard and its consistency policy decide that).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pswire.errors import InvalidRequestError
from pswire.job import Job
from pswire.rowstore import RowStore, TableState
from pswire.tables import RowSparse


class Variables:
    """What one shard stores for its job: empty until ``install`` or ``restore``."""

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict] = {}
        self.tables: dict[str, RowStore] = {}

    def install(self, job: Job, values: Mapping[str, np.ndarray], take: bool) -> None:
        """Starting values (checked against ``job`` by the caller) and fresh optimizer state;
        tables start from their seeded initialiser: no worker sends (or holds) them.

        ``take``: the caller hands the arrays over, so writable ones of the right dtype are
        kept as they are instead of copied.
        """
        specs = job.specs
        self.values = {
            key: _owned(values[key], spec.dtype, take)
            for key, spec in specs.items()
            if spec.table is None
        }
        self.slots = {
            k: job.optimizer.make_state(v) for k, v in self.values.items() if not specs[k].average
        }
        self.tables = {
            key: RowStore(spec.table, job.optimizer)
            for key, spec in specs.items()
            if spec.table is not None
        }

    def apply(self, job: Job, update: Mapping[str, Any]) -> None:
        """One optimizer step with ``update`` (gradients by key; rows for tables).

        A buffer (e.g. BatchNorm running stats) takes the pushed values (averaged over the
        round in sync mode) with no optimizer.
        """
        opt = job.optimizer
        for key, grad in update.items():
            if isinstance(grad, RowSparse):
                self.tables[key].apply(grad.ids, grad.values)
            elif job.specs[key].average:
                np.copyto(self.values[key], grad, casting="unsafe")
            else:
                opt.apply_blocked(self.values[key], grad, self.slots[key])

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values.values()) + sum(
            t.nbytes for t in self.tables.values()
        )

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, dict], dict[str, TableState]]:
        """Copies of (variables, optimizer slots, tables), for a checkpoint."""
        return (
            {k: v.copy() for k, v in self.values.items()},
            {k: _copy_slots(s) for k, s in self.slots.items()},
            {k: t.export() for k, t in self.tables.items()},
        )

    @staticmethod
    def restored(
        job: Job,
        values: Mapping[str, np.ndarray],
        slots: Mapping[str, dict],
        tables: Mapping[str, TableState],
    ) -> Variables:
        """The state a checkpoint holds, checked against its own job.

        Raises:
            InvalidRequestError: the state does not match its job.
        """
        job.check_values(values)
        specs = {v.key: v.table for v in job.variables if v.table is not None}
        if set(specs) != set(tables):
            raise InvalidRequestError(
                f"the state holds tables {sorted(tables)}, its job declares {sorted(specs)}"
            )
        out = Variables()
        out.tables = {
            k: RowStore.restore(spec, job.optimizer, tables[k]) for k, spec in specs.items()
        }
        out.values = {k: np.array(v, copy=True) for k, v in values.items()}
        out.slots = {k: _copy_slots(s) for k, s in slots.items()}
        return out


def _owned(array: np.ndarray, dtype: str, take: bool) -> np.ndarray:
    """``array`` itself if it may be kept (handed over, writable, C-contiguous, the variable's
    dtype), else a copy."""
    keep = take and array.flags.writeable and array.flags.c_contiguous
    if keep and array.dtype == np.dtype(dtype):
        return array
    return np.array(array, dtype=np.dtype(dtype), copy=True)


def _copy_slots(slots: dict) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in slots.items()}
