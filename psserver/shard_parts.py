"""What ``Shard``'s parts (``Roster``, ``Joins``, ``Reports``, ``OptimizerSide``) use of the
shard: its state, and the methods ``Shard`` or another part provides. Declared once here, the
base of every part, so each part type-checks alone without repeating them."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pscore.job import Job
from pscore.variables import Variables
from psserver.agreement import JobAgreement
from psserver.consistency import Clocks, ConsistencyPolicy
from psserver.history import MembershipHistory
from psserver.membership import Membership
from psserver.records import Limits


class ShardParts:
    """The shard's state (set by ``Shard.__init__``) and its shared methods (lock held)."""

    limits: Limits
    _cond: threading.Condition
    _now: Callable[[], float]
    _agreement: JobAgreement
    _policy: ConsistencyPolicy | None
    _state: Variables
    _finished: dict[int, int]
    _members: Membership
    _history: MembershipHistory
    _ready: bool
    _updates: int
    _opened: int
    _counters: dict[str, int]
    _durable: dict[int, int]
    _checkpoint_step: int
    _checkpoint_time: float | None
    _failure: str

    # Shard's own.
    def _require_job(self) -> Job:
        raise NotImplementedError

    def _require_policy(self) -> ConsistencyPolicy:
        raise NotImplementedError

    def _check_worker(self, worker_id: int, num_workers: int, what: str) -> None:
        raise NotImplementedError

    def _touch(self, worker_id: int) -> None:
        raise NotImplementedError

    def _clocks(self) -> Clocks:
        raise NotImplementedError

    def _membership_changed(self) -> None:
        raise NotImplementedError

    def _wait(
        self,
        ready: Callable[[], bool],
        timeout: float | None,
        cancelled: threading.Event | None,
        describe: Callable[[], str],
    ) -> None:
        raise NotImplementedError

    def _wait_values(self, timeout: float | None, cancelled: threading.Event | None) -> None:
        raise NotImplementedError

    # One part's, used by another.
    def _record(self, step: int, worker_id: int, kind: str) -> None:  # Joins'
        raise NotImplementedError

    def _start_optimizer_side(self, job: Job | None) -> None:  # OptimizerSide's
        raise NotImplementedError

    def _capture_due(self) -> None:  # Reports'
        raise NotImplementedError
