"""``mode="local"``: one process, no network; a one-shard job's state applied in place.

The client holds what a single shard would (``pscore.variables.Variables`` under a ``Job`` of
one shard) and applies every push through the same checks and the same ``Variables.apply`` as
a shard, so ``local`` is the reference by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pscore.job import Job, VarSpec
from pscore.optim import Optimizer
from pscore.optspec import StepOptions, resolve_groups
from pscore.rowstore import RowStore
from pscore.tables import RowSparse, Table, as_ids
from pscore.variables import Variables, same_memory
from pswire.errors import ClientClosedError, NotInitializedError, not_in_model
from psworker.api import push_then_pull
from psworker.placement import TableLayout, check_out


class LocalClient:
    """The ``Client`` role for a single worker: the reference every mode is tested against.

    Pushes are applied at once, like a one-worker ``sync`` job, through the shards' own step
    (``Job.checked_grads``, ``Job.step_optimizers``, ``Variables.apply``).
    """

    mode = "local"
    staleness = 0
    worker_id = 0
    num_workers = 1
    addresses: list[str] = []

    def __init__(self) -> None:
        self.step = 0
        self.last_skipped = False  # the step last pushed had no optimizer update
        self._job: Job | None = None
        self._state = Variables()
        self._layouts: dict[str, TableLayout] = {}
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
        fixed: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Copies the starting values and creates the optimizer state; ``tables`` are made
        here with the shards' seeded rows (a fixed table's rows as they are first touched).
        ``optimizer`` and ``groups`` as ``PSClient.init``; ``fixed`` has no one to agree with.

        Raises:
            InvalidRequestError: bad parameter groups.
            ClientClosedError: the client was closed.
        """
        self._require_open()
        tables = tables or {}
        optimizers, group = resolve_groups(optimizer, groups, [*variables, *tables])
        arrays = {k: np.asarray(v) for k, v in variables.items()}
        self._layouts = {n: TableLayout.build(n, t, 1) for n, t in tables.items()}
        specs = [
            VarSpec(k, tuple(a.shape), a.dtype.name, k in buffers, group=group[k])
            for k, a in arrays.items()
        ] + [VarSpec.of_table(t.slice_for(0), group[n]) for n, t in self._layouts.items()]
        job = Job(
            self.mode, 0, 1, optimizers[0], tuple(specs), "", groups=tuple(optimizers[1:]),
            num_shards=1,
        )  # fmt: skip
        state = Variables()
        state.install(job, arrays, take=False)
        self._job, self._state = job, state

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
        values = self._state.values
        wanted = list(names) if names is not None else list(values)
        for name in wanted:
            if name not in values:
                raise not_in_model(name, values)
        if not out:
            return {k: values[k].copy() for k in wanted}
        check_out(out, {k: (values[k].shape, values[k].dtype.name) for k in wanted})
        for name, array in out.items():
            if not same_memory(array, values[name]):  # not the memory ``keep_in`` gave
                np.copyto(array, values[name])
        return {k: out[k] if k in out else values[k].copy() for k in wanted}

    def keep_in(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Holds the values of ``arrays``' variables in those arrays from now on: a CPU
        model's own memory (``DistributedOptimizer`` gives it), so a step updates the model in
        place and a pull into the same memory copies nothing. Writing to them between steps
        (``p.data.clamp_()``) changes the values, as it would with a torch optimizer.

        Raises:
            UnknownVariableError, InvalidRequestError: a name not in the model, or an array of
                another shape or dtype, read-only or not contiguous.
        """
        self._require_init()
        self._state.keep_in(arrays)

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
        *,
        known_squares: Mapping[str, float] | None = None,
    ) -> bool:
        """Applies one step's gradients (buffers: stores the values) at once, with
        ``options``' hyper-parameters; a skip (``options.skip``) stores buffers only.
        ``known_squares``: sums of squares of some of these gradients, already measured (the
        all-reduce's, as its ring wrote them), which the checks then trust instead of
        measuring them again.

        Raises:
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: as a shard would
                (the same checks); nothing changes then.
            StepRefusedError: the result would not be finite; nothing changed.
        """
        job = self._require_init()
        step = self.step if step is None else step
        if step < self.step:
            return False  # already applied, as a shard acknowledges a retried push
        wire: dict[str, np.ndarray | RowSparse] = {}
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                ids = as_ids(name, grad.ids)
                self._table(name)[0].check_ids(ids, "push")  # a client's check, as PSClient's
                wire[name] = RowSparse(ids, np.asarray(grad.values))
            else:
                wire[name] = np.asarray(grad)
        # Measured by the ring or by the checks, and not again by the step.
        squares = dict(known_squares or {})
        checked = job.checked_grads(wire, squares)
        optimizers = job.step_optimizers(options)
        skip = bool(options and options.skip)
        self._state.apply(job, checked, optimizers, skip=skip, summed=False, known_squares=squares)
        self.step = step + 1
        self.last_skipped = skip
        return True

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
        rows: Mapping[str, np.ndarray | Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """``push``, then ``pull`` and ``pull_rows`` (``psworker.api.push_then_pull``)."""
        return push_then_pull(self, grads, step, out, options, rows)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Copies of every trained variable's optimizer slots (slots not made yet left out)."""
        self._require_init()
        return self._state.optimizer_state()

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
        job = self._require_init()
        self._state.load(job, values or {}, slots)

    def heartbeat(self) -> None:
        """No servers to tell."""

    def status(self) -> list:
        return []

    def _table(self, name: str) -> tuple[TableLayout, RowStore]:
        layout = self._layouts.get(name)
        if layout is None:
            raise not_in_model(name, self._layouts, "table")
        return layout, self._state.tables[name]

    def _require_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed: connect again")

    def _require_init(self) -> Job:
        self._require_open()
        if self._job is None:
            raise NotInitializedError("call client.init(variables, optimizer) before pull or push")
        return self._job
