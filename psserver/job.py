"""The job a shard serves and the plain records it hands back: specs, limits, results, state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from psserver.consistency import make_policy
from pswire.codec import check_tensor
from pswire.errors import InvalidRequestError, TooLargeError, UnknownVariableError
from pswire.optim import Optimizer
from pswire.rowstore import TableState
from pswire.tables import TableSlice

OBSERVER = -1  # worker_id of a reader that is not one of the job's workers


@dataclass(frozen=True)
class VarSpec:
    """A variable (or slice) on this shard; ``average``: a buffer, not trained (see _apply);
    ``table``: an embedding table's slice, read and written by rows."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    average: bool = False
    table: TableSlice | None = None


@dataclass(frozen=True)
class Job:
    """What every worker of a job must agree on with this shard."""

    mode: str
    staleness: int
    num_workers: int
    optimizer: Optimizer
    variables: tuple[VarSpec, ...]
    model_digest: str
    quorum: int = 0

    def check(self, limits: Limits) -> None:
        """Validates the job against a shard's limits.

        Raises:
            InvalidRequestError: bad worker count, mode, duplicate names or table slices.
            TooLargeError: more variables than the limit.
        """
        if self.num_workers < 1 or self.num_workers > limits.max_workers:
            raise InvalidRequestError(
                f"num_workers must be in [1, {limits.max_workers}], got {self.num_workers}"
            )
        make_policy(self.mode, self.staleness, self.quorum)  # validates mode, staleness, quorum
        if len(self.variables) > limits.max_variables:
            raise TooLargeError(
                f"job declares {len(self.variables)} variables on this shard, over the limit "
                f"of {limits.max_variables}"
            )
        keys = [v.key for v in self.variables]
        if len(set(keys)) != len(keys):
            raise InvalidRequestError(f"job declares a variable twice: {keys}")
        for v in self.variables:
            if v.table is not None:
                v.table.check(self.optimizer)
                if v.shape != (v.table.local_rows, v.table.dim) or v.dtype != v.table.dtype:
                    raise InvalidRequestError(
                        f"table '{v.key}' declares shape {v.shape} {v.dtype}, but its slice "
                        f"holds ({v.table.local_rows}, {v.table.dim}) {v.table.dtype}"
                    )

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

    def differences(self, other: Job) -> list[str]:
        """Human-readable list of what differs from ``other`` (the shard's job)."""
        out = []
        for attr in ("mode", "staleness", "num_workers", "model_digest", "quorum"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            if mine != theirs:
                out.append(f"{attr}: shard has {theirs!r}, worker sent {mine!r}")
        if self.optimizer != other.optimizer:
            out.append(f"optimizer: shard has {other.optimizer}, worker sent {self.optimizer}")
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
    text = f"{v.shape} {v.dtype}"
    return text if v.table is None else f"{text}, table {v.table}"


@dataclass(frozen=True)
class Limits:
    max_workers: int = 1024
    max_variables: int = 100_000
    max_request_bytes: int = 8 << 30
    max_wait_s: float = 300.0
    heartbeat_timeout_s: float = 30.0  # silent this long: out of the sync/ssp quorum; 0: never


@dataclass
class PushResult:
    applied: bool
    reason: str  # "duplicate" or "late" when not applied
    clock: int
    durable_step: int


@dataclass(frozen=True)
class Registration:
    clock: int  # the step the worker (re)joins at
    initialized: bool
    durable_step: int


@dataclass(frozen=True)
class ShardState:
    """Everything a checkpoint holds: enough for a restarted shard to go on exactly."""

    job: Job
    variables: dict[str, np.ndarray]
    slots: dict[str, dict]
    updates: int
    finished: dict[int, int]
    counters: dict[str, int]
    tables: dict[str, TableState] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardStatus:
    initialized: bool
    job: Job | None
    clock: int
    workers: dict[int, tuple[int, float]]  # worker -> (steps finished, seconds since heard)
    live: frozenset[int]
    total_bytes: int
    pushes_applied: int
    pushes_duplicate: int
    pushes_late: int
    checkpoint_step: int
    checkpoint_age_s: float
    tables: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    # table -> (rows, bytes, evictions, capacity)
