"""The job description both ends agree on (``Job``, ``VarSpec``) and the checks of a step
against it; its protobuf form is ``pswire.jobspec``."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pscore.checks import all_finite_together, batched, check_dtype, check_tensor
from pscore.optim import Optimizer
from pscore.optspec import StepOptions, group_optimizers
from pscore.tables import RowSparse, TableSlice, check_rows
from pswire.errors import InvalidRequestError, TooLargeError, UnknownVariableError

Grads = dict[str, np.ndarray | RowSparse]


OBSERVER = -1  # worker_id of a reader that is not one of the job's workers
# Consistency modes a parameter-server job runs in (psserver/consistency has one rule each).
MODES = ("sync", "async", "ssp")
# What an optimizer can train (integer and bool variables travel as buffers).
TRAINABLE_DTYPES = ("float16", "float32", "float64")
# Every mode a worker may train in: the shards' modes, the two without shards, and local steps
# with an outer optimizer on the shards (DiLoCo: sync or async on the shards, psworker/diloco.py).
CLIENT_MODES = (*MODES, "allreduce", "local", "diloco")
# What separates the model's digest from a training variant's settings in ``Job.model_digest``.
VARIANT_MARK = "|"
# What precedes, in the model's part of it, the digest of values every worker holds alike but
# never sends (``fixed_digest``: parameters in no optimizer group).
FIXED_MARK = "+fixed:"


def digest_parts(digest: str) -> tuple[str, str, str]:
    """A ``Job.model_digest``'s parts: the model's own digest, the digest of the values never
    sent (after ``FIXED_MARK``; "" for none) and the training variant's settings (after
    ``VARIANT_MARK``; "" for none)."""
    model, _, variant = digest.partition(VARIANT_MARK)
    model, _, fixed = model.partition(FIXED_MARK)
    return model, fixed, variant


def keeping_fixed(job: Job, held: Job) -> Job:
    """``job`` with ``held``'s digest of the values never sent (after ``FIXED_MARK``): a
    worker that restarts into a job it has pushed steps of is not judged on them, as it may
    hold others by then (a script's own EMA target network, restored from its checkpoint)."""
    model, _, variant = digest_parts(job.model_digest)
    fixed = digest_parts(held.model_digest)[1]
    digest = model + (FIXED_MARK + fixed if fixed else "")
    return replace(job, model_digest=digest + (VARIANT_MARK + variant if variant else ""))


def fixed_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """A digest of ``arrays``' names, dtypes, shapes and bytes (16 hex digits)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.data)  # no copy of a large frozen backbone
    return h.hexdigest()[:16]


def check_mode(mode: str, staleness: int = 0, quorum: int = 0) -> None:
    """Validates a job's consistency settings.

    Raises:
        InvalidRequestError: unknown mode, a negative staleness or quorum, quorum outside sync.
    """
    if mode not in MODES:
        raise InvalidRequestError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
    if quorum < 0:
        raise InvalidRequestError(f"quorum must be >= 0, got {quorum}")
    if quorum and mode != "sync":
        raise InvalidRequestError(f"quorum (backup workers) is a sync option; mode is {mode!r}")
    if mode == "ssp" and staleness < 0:
        raise InvalidRequestError(f"ssp staleness must be >= 0, got {staleness}")


def check_elastic(min_workers: int, max_workers: int, num_workers: int) -> None:
    """Validates an elastic job's bounds (both 0: a job of fixed size).

    Raises:
        InvalidRequestError: bounds out of order, or a worker count other than the maximum.
    """
    if not max_workers and not min_workers:
        return
    if not 1 <= min_workers <= max_workers:
        raise InvalidRequestError(
            f"an elastic job needs 1 <= min_workers <= max_workers, got min_workers "
            f"{min_workers}, max_workers {max_workers}"
        )
    if num_workers != max_workers:
        raise InvalidRequestError(
            f"an elastic job's num_workers is its max_workers ({max_workers}), got {num_workers}"
        )


@dataclass(frozen=True)
class VarSpec:
    """A variable (or slice) on this shard; ``average``: a buffer, not trained (see _apply);
    ``table``: an embedding table's slice, read and written by rows; ``group``: its
    parameter group (index into ``Job.optimizers``)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    average: bool = False
    table: TableSlice | None = None
    group: int = 0

    @classmethod
    def of_table(cls, table: TableSlice, group: int = 0) -> VarSpec:
        """The spec of one shard's slice of an embedding table."""
        return cls(table.key, (table.local_rows, table.dim), table.dtype, table=table, group=group)


@dataclass(frozen=True)
class Job:
    """What every worker of a job must agree on with this shard.

    ``optimizer`` is parameter group 0's; ``groups`` the groups after it (other
    hyper-parameters, or another class: the optimizers of two models trained together).
    Pushes may replace hyper-parameters per update (``StepOptions``); these are the values
    the job started with.
    """

    mode: str
    staleness: int
    num_workers: int
    optimizer: Optimizer
    variables: tuple[VarSpec, ...]
    model_digest: str
    quorum: int = 0
    # The job's identity, fixed at its first init (worker 0's proposal) and kept in
    # checkpoints; not part of what workers must agree on (``differences`` ignores it).
    job_id: str = ""
    groups: tuple[Optimizer, ...] = ()
    # An elastic job (max_workers > 0): members join and leave while it runs; it trains only
    # with at least min_workers of them. num_workers is max_workers (the worker-id space).
    min_workers: int = 0
    max_workers: int = 0
    # This shard's place in the placement: shard ``shard`` of ``num_shards`` (0 of 0: not
    # said, as from a checkpoint older than this field). See ``placement_difference``.
    shard: int = 0
    num_shards: int = 0

    @property
    def elastic(self) -> bool:
        """Whether workers may join and leave this job while it runs."""
        return self.max_workers > 0

    @functools.cached_property
    def optimizers(self) -> tuple[Optimizer, ...]:
        """Every parameter group's optimizer, group 0 first."""
        return (self.optimizer, *self.groups)

    def optimizer_of(self, key: str) -> Optimizer:
        """The optimizer (as the job started) of variable or table ``key``'s group."""
        return self.optimizers[self.specs[key].group]

    def step_optimizers(self, options: StepOptions | None) -> tuple[Optimizer, ...]:
        """Each group's optimizer for an update pushed with ``options``.

        Raises:
            InvalidRequestError: a bad group or value (e.g. weight decay for a table's group).
        """
        out = group_optimizers(self.optimizers, options)
        if options is not None and options.values:
            for v in self.variables:
                if v.table is not None and out[v.group] is not self.optimizers[v.group]:
                    v.table.check(out[v.group])
        return out

    def check(self, max_workers: int, max_variables: int, max_state_bytes: int = 0) -> None:
        """Validates the job against a shard's limits (``max_state_bytes`` 0: none).

        Raises:
            InvalidRequestError: bad worker count, mode, duplicate names or table slices, a
                trainable variable that is not floating point.
            TooLargeError: more variables, or more bytes of state, than the limits.
        """
        if self.num_workers < 1 or self.num_workers > max_workers:
            raise InvalidRequestError(
                f"num_workers must be in [1, {max_workers}], got {self.num_workers}"
            )
        check_mode(self.mode, self.staleness, self.quorum)
        check_elastic(self.min_workers, self.max_workers, self.num_workers)
        if self.num_shards < 0 or not (self.shard == 0 or 0 <= self.shard < self.num_shards):
            raise InvalidRequestError(
                f"the job is for shard {self.shard} of {self.num_shards}: expected "
                "0 <= shard < num_shards"
            )
        if len(self.variables) > max_variables:
            raise TooLargeError(
                f"job declares {len(self.variables)} variables on this shard, over the limit "
                f"of {max_variables}"
            )
        keys = [v.key for v in self.variables]
        if len(set(keys)) != len(keys):
            raise InvalidRequestError(f"job declares a variable twice: {keys}")
        for v in self.variables:
            if not 0 <= v.group < len(self.optimizers):
                raise InvalidRequestError(
                    f"variable '{v.key}' is in parameter group {v.group}; the job has groups "
                    f"0..{len(self.optimizers) - 1}"
                )
            if v.table is None and not v.average and v.dtype not in TRAINABLE_DTYPES:
                raise InvalidRequestError(
                    f"variable '{v.key}' is {v.dtype}: only {', '.join(TRAINABLE_DTYPES)} "
                    "variables can be trained (integer and bool state travels as a buffer)"
                )
        if max_state_bytes and self.state_bytes() > max_state_bytes:
            raise TooLargeError(
                f"job declares {self.state_bytes() / 2**30:.2f} GiB of variables, optimizer "
                f"state and table rows on this shard, over its memory limit of "
                f"{max_state_bytes / 2**30:.2f} GiB (psserver --memory-limit)"
            )
        for v in self.variables:
            if v.table is not None:
                v.table.check(self.optimizers[v.group])
                if v.shape != (v.table.local_rows, v.table.dim) or v.dtype != v.table.dtype:
                    raise InvalidRequestError(
                        f"table '{v.key}' declares shape {v.shape} {v.dtype}, but its slice "
                        f"holds ({v.table.local_rows}, {v.table.dim}) {v.table.dtype}"
                    )

    def state_bytes(self) -> int:
        """The bytes this shard's part of the job holds once initialised: every dense variable
        and its optimizer slots, and every table's rows and slots at their bound (a fixed
        slice's rows, a dynamic table's capacity; a dynamic table without one counts nothing
        until rows are made)."""
        per_group = [1 + _slot_arrays(o) for o in self.optimizers]
        total = 0
        for v in self.variables:
            per_element = per_group[v.group] if 0 <= v.group < len(per_group) else per_group[0]
            itemsize = np.dtype(check_dtype(v.dtype, v.key)).itemsize
            if v.table is not None:
                rows = v.table.local_rows if not v.table.dynamic else v.table.capacity
                total += rows * v.table.dim * itemsize * per_element
            else:
                elements = int(np.prod(v.shape, dtype=np.int64))
                total += elements * itemsize * (1 if v.average else per_element)
        return total

    def check_values(self, values: Mapping[str, np.ndarray]) -> None:
        """Validates initial values against the job's dense variables (tables are never sent).

        Raises:
            UnknownVariableError: a value for a variable the job lacks.
            InvalidRequestError: a missing value, a table's value, wrong dtype or NaN.
            ShapeMismatchError: wrong shape.
        """
        specs = {v.key: v for v in self.variables if v.table is None}
        for v in self.variables:
            if v.table is not None and v.key in values:
                raise InvalidRequestError(
                    f"initial values for table '{v.key}': tables start from their seeded "
                    "initialiser on the shards and are never sent"
                )
        for key in values:
            if key not in specs:
                raise UnknownVariableError(
                    f"initial value for variable '{key}', which the job does not declare"
                )
        for key, spec in specs.items():
            if key not in values:
                raise InvalidRequestError(f"initial values lack variable '{key}'")
            check_tensor(key, spec.shape, spec.dtype, values[key], "initial value")

    @functools.cached_property
    def specs(self) -> dict[str, VarSpec]:
        """The variables by key."""
        return {v.key: v for v in self.variables}

    def unknown(self, key: str) -> str:
        """The message for a variable this shard's part of the job lacks."""
        known = sorted(self.specs)
        shown = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "")
        return f"variable '{key}' is not on this shard (it holds: {shown})"

    def pull_keys(
        self, names: Sequence[str], rows: Sequence[tuple[str, np.ndarray | None]]
    ) -> list[str]:
        """The dense variables a pull reads, its row query checked: ``names``, or with none
        every variable that is not a table (none when ``rows`` are asked for). Ids None: every
        row this shard holds of a dynamic table (``psctl export``).

        Raises:
            UnknownVariableError: a name the job lacks.
            InvalidRequestError: a table named as a whole, rows of a dense variable, one table
                asked twice, bad row ids, every row of a fixed table.
        """
        if names:
            keys = list(names)
        else:
            keys = [] if rows else [v.key for v in self.variables if v.table is None]
        for key in keys:
            spec = self.specs.get(key)
            if spec is None:
                raise UnknownVariableError(self.unknown(key))
            if spec.table is not None:
                raise InvalidRequestError(
                    f"'{key}' is an embedding table: pull its rows by id, not the whole table"
                )
        seen: set[str] = set()
        for table, ids in rows:
            spec = self.specs.get(table)
            if spec is None:
                raise UnknownVariableError(self.unknown(table))
            if spec.table is None:
                raise InvalidRequestError(f"rows of '{table}', which is not an embedding table")
            if table in seen:
                raise InvalidRequestError(f"one pull asks for rows of table '{table}' twice")
            seen.add(table)
            if ids is not None:
                check_rows(spec.table, ids, None, "pull")
            elif not spec.table.dynamic:
                raise InvalidRequestError(
                    f"a pull asks for every row of table '{table}', which is fixed: ask for "
                    f"its ids [{spec.table.row_start}, {spec.table.row_end}) on this shard"
                )
        return keys

    def checked_grads(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        squares: dict[str, float] | None = None,
    ) -> Grads:
        """A push's gradients, validated against the job; float16 gradients of float32
        variables (wire compression) widened to float32, so averaging and the optimizer run in
        float32. (bfloat16 arrives already widened.) ``squares``, when given, holds sums of
        squares of some of these very arrays already measured (a finite one proves its array
        finite: not checked again) and receives those the finite check measures
        (``check_tensor``), by key: a step applying these gradients passes them to
        ``Variables.apply``, which then does not measure them again.

        Raises:
            UnknownVariableError: a gradient for a variable the job lacks.
            ShapeMismatchError, InvalidRequestError: wrong shape or dtype, non-finite values,
                dense rows for a table or rows for a dense variable, bad row ids.
        """
        out: Grads = {}
        finite = all_finite_together(grads.values())  # many small ones: at once
        for key, grad in grads.items():
            spec = self.specs.get(key)
            if spec is None:
                raise UnknownVariableError(self.unknown(key))
            if spec.table is not None:
                if not isinstance(grad, RowSparse) and grad.shape[:1] == (0,):
                    # No rows on this shard, the table stepped (pswire carries empty ids as
                    # none: a tensor without indices).
                    grad = RowSparse(np.empty(0, np.int64), grad)
                if not isinstance(grad, RowSparse):
                    raise InvalidRequestError(
                        f"table '{key}' takes row-sparse gradients (ids with rows), got a dense "
                        f"tensor of shape {grad.shape}"
                    )
                if grad.values.dtype == np.float16 and spec.dtype == "float32":
                    grad = RowSparse(grad.ids, grad.values.astype(np.float32))
                check_rows(spec.table, grad.ids, grad.values, "push")
            elif isinstance(grad, RowSparse):
                raise InvalidRequestError(
                    f"variable '{key}' is dense, but the push sent rows by id (not a table)"
                )
            else:
                known = finite and batched(grad)
                if grad.dtype == np.float16 and spec.dtype == "float32" and not spec.average:
                    grad = grad.astype(np.float32)
                elif squares is not None and key in squares:
                    known = known or bool(np.isfinite(squares[key]))
                what = "buffer value" if spec.average else "gradient"
                measured = check_tensor(key, spec.shape, spec.dtype, grad, what, known)
                if squares is not None and measured is not None:
                    squares[key] = measured
            out[key] = grad
        return out

    def placement_difference(self, other: Job) -> str:
        """What differs in this shard's place in the placement from ``other`` (the shard's
        job, perhaps restored from a checkpoint), or "" (also when either does not say)."""
        if not (self.num_shards and other.num_shards):
            return ""
        if (self.shard, self.num_shards) == (other.shard, other.num_shards):
            return ""
        return (
            f"placement: this shard holds shard {other.shard} of {other.num_shards} shards, "
            f"the worker sent shard {self.shard} of {self.num_shards}'s part (restore each "
            f"shard from its own checkpoint folder, with the same number of shards, "
            f"{other.num_shards})"
        )

    def differences(self, other: Job) -> list[str]:
        """Human-readable list of what differs from ``other`` (the shard's job)."""
        placement = self.placement_difference(other)
        out = [placement] if placement else []
        attrs = ("mode", "staleness", "num_workers", "quorum")
        for attr in (*attrs, "min_workers", "max_workers"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            if mine != theirs:
                out.append(f"{attr}: shard has {theirs!r}, worker sent {mine!r}")
        # The digest may end in the training variant (``|diloco(...)``, psworker/diloco.py):
        # said apart from the model, with its settings, so the refused worker sees which.
        mine_model, mine_fixed, mine_variant = digest_parts(self.model_digest)
        theirs_model, theirs_fixed, theirs_variant = digest_parts(other.model_digest)
        if mine_model != theirs_model:
            out.append(f"model_digest: shard has {theirs_model!r}, worker sent {mine_model!r}")
        elif mine_fixed != theirs_fixed:
            out.append(
                "parameters in no optimizer group (never sent, so every worker must hold the "
                "same values: load them, or seed alike before building the model): shard has "
                f"values with digest {theirs_fixed or 'none'}, worker sent "
                f"{mine_fixed or 'none'}"
            )
        if mine_variant != theirs_variant:
            out.append(
                f"local steps (DiLoCo): shard has {theirs_variant or 'none'}, worker sent "
                f"{mine_variant or 'none'}"
            )
        if self.optimizers != other.optimizers:
            out.append(
                f"optimizer (parameter groups): shard has {list(other.optimizers)}, worker sent "
                f"{list(self.optimizers)}"
            )
        if self.variables != other.variables:
            theirs_by = {v.key: v for v in other.variables}
            mine_by = {v.key: v for v in self.variables}
            for key in sorted(set(theirs_by) | set(mine_by)):
                a, b = theirs_by.get(key), mine_by.get(key)
                if a != b:
                    out.append(
                        f"variable '{key}': shard has {_describe(a)}, worker sent {_describe(b)}"
                    )
        return out


def _describe(v: VarSpec | None) -> str:
    if v is None:
        return "nothing"
    text = f"{v.shape} {v.dtype}" + (f", group {v.group}" if v.group else "")
    return text if v.table is None else f"{text}, table {v.table}"


def _slot_arrays(optimizer: Optimizer) -> int:
    """How many arrays the size of a variable the optimizer keeps per variable."""
    state = optimizer.make_state(np.zeros(1, np.float32))
    return sum(1 for v in state.values() if v is None or isinstance(v, np.ndarray))
