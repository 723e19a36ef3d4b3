"""The one client role: what a training loop and ``DistributedOptimizer`` may ask of any client.

Parameter-server (``PSClient``), single-process (``LocalClient``) and all-reduce
(``AllReduceClient``) clients all implement it, so callers never branch on which they hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, runtime_checkable

import numpy as np

from pscore.optim import Optimizer
from pscore.optspec import StepOptions
from pscore.tables import RowSparse, Table


@runtime_checkable
class Client(Protocol):
    """A worker's view of one training job.

    ``step`` is the step the next push is for; ``mode`` one of ``sync``, ``async``, ``ssp``,
    ``allreduce``, ``local``; ``last_skipped`` whether the step last pushed had no optimizer
    update (a worker's GradScaler skipped it: in ``sync`` and ``allreduce`` any worker's, known
    once ``push_pull`` returns). Every call has a deadline and raises a ``PSError`` subclass on
    failure.
    """

    mode: str
    worker_id: int
    num_workers: int
    step: int

    @property
    def last_skipped(self) -> bool:
        """Whether the step last pushed had no optimizer update (see above)."""
        ...

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer | Sequence[Optimizer],
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
        fixed: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Agrees on the model with the job; worker 0's values become the starting weights.
        ``optimizer``: one, or one per parameter group (any classes); ``groups``: the group
        of each variable or table named (others: 0). ``fixed``: arrays every worker must hold
        alike that are never trained nor sent (parameters in no optimizer group); where
        workers train apart from each other (the shards' modes) a worker whose differ from
        worker 0's is refused, and ``allreduce`` overwrites them with rank 0's, as DDP."""
        ...

    def pull(
        self, names: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """The current weights, once the mode's rule lets this worker read."""
        ...

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Rows ``ids`` of an embedding table, in the order asked."""
        ...

    def push(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        options: StepOptions | None = None,
    ) -> bool:
        """This worker's gradients for one step, with ``options`` (hyper-parameters that
        differ from the job's, a skip); whether they were applied."""
        ...

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
        rows: Mapping[str, np.ndarray | Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """``push(grads, step, options)`` then ``pull(out=out)`` and ``pull_rows`` of ``rows``
        (table -> ids, returned under the table's name), in one round trip where it can."""
        ...

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Every trained variable's optimizer slots (arrays, counts as ints)."""
        ...

    def load_state(
        self,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        digest: str,
    ) -> None:
        """Worker 0's ``values`` and ``slots`` become the job's; the other workers check they
        loaded the same (``digest``)."""
        ...

    def close(self) -> None:
        """Releases the connections; the client is unusable afterwards."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class Members:
    """Who trains at ``step`` in an elastic job, and every change before it: ``rosters`` are
    (first step, members) pairs, oldest first (the members of a step are those of the last
    roster starting at or before it)."""

    step: int
    members: tuple[int, ...]
    rosters: tuple[tuple[int, tuple[int, ...]], ...]
    min_workers: int
    max_workers: int

    def at(self, step: int) -> tuple[int, ...]:
        """The members that trained at ``step`` (``step`` at most ``self.step``)."""
        found: tuple[int, ...] = ()
        for start, members in self.rosters:
            if start > step:
                break
            found = members
        return found


@runtime_checkable
class Elastic(Protocol):
    """A client of a job whose workers come and go (``ElasticPSClient``): ``shard()`` asks it
    who trains when, to split the data among the members of each epoch."""

    worker_id: int
    step: int
    min_workers: int
    max_workers: int

    def members(self, step: int | None = None) -> Members:
        """The members at ``step`` (default: this worker's), once ``step`` may be read."""
        ...


@runtime_checkable
class Replica(Protocol):
    """A client whose values live in this process (``LocalClient``, ``AllReduceClient``): it
    can hold them in the model's own memory, so a step updates the model in place."""

    def keep_in(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Holds the values of ``arrays``' variables in those arrays from now on."""
        ...


def push_then_pull(
    client: Client,
    grads: Mapping[str, np.ndarray | RowSparse],
    step: int | None = None,
    out: Mapping[str, np.ndarray] | None = None,
    options: StepOptions | None = None,
    rows: Mapping[str, np.ndarray | Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """``push_pull`` for clients whose weights are local, so there is no round trip to fuse
    (``LocalClient``, ``AllReduceClient``): ``client.push(grads, step, options)``, then
    ``pull(out=out)`` and each table's ``pull_rows`` of ``rows``, under the table's name.

    Raises:
        as the client's ``push``, ``pull`` and ``pull_rows``.
    """
    client.push(grads, step, options)
    weights = client.pull(out=out)
    return {**weights, **{t: client.pull_rows(t, ids) for t, ids in (rows or {}).items()}}
