"""The plain records a shard hands back: its limits, push results, registrations, state."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pscore.job import Job
from pscore.rowstore import TableState
from psserver.history import MembershipEvent


@dataclass(frozen=True)
class Limits:
    """What a shard accepts and how long it waits (psserver's --max-* flags)."""

    max_workers: int = 1024
    max_variables: int = 100_000
    max_request_bytes: int = 8 << 30
    max_wait_s: float = 300.0
    heartbeat_timeout_s: float = 30.0  # silent this long: out of the sync/ssp quorum; 0: never
    # A push may be for at most this many steps beyond the one the shard expects from its
    # worker: a step far ahead would make that worker's real pushes look like retries. Gaps
    # are legitimate only after pushes another shard took and this one refused.
    max_step_ahead: int = 16
    # The bytes a job's state may take on the shard (variables, optimizer slots, table rows at
    # their bound); 0: no limit.
    memory_limit_bytes: int = 0
    # A worker id held by a process heard within this long is refused to another process.
    claim_grace_s: float = 5.0
    # The folder (and its subfolders) a table's init_from file must be in: a worker names the
    # file and reads it back through the table's rows, so no file elsewhere on this host is
    # reachable. Relative to the shard's working directory.
    table_files: str = "."


@dataclass
class PushResult:
    applied: bool
    reason: str  # "duplicate" or "late" when not applied
    clock: int
    durable_step: int
    next_step: int  # the step the worker reads at and pushes next
    absent: tuple[int, ...] = ()  # the job's workers out of the quorum now (sync/ssp)
    job_id: str = ""
    skipped: bool = False  # the step had no optimizer update (sync: known after its pull)


@dataclass(frozen=True)
class Registration:
    clock: int  # the step the worker (re)joins at
    initialized: bool
    durable_step: int
    job_id: str = ""


@dataclass(frozen=True)
class Beat:
    """A heartbeat's answer."""

    clock: int  # the steps the worker has finished on this shard
    fastest_seconds_per_step: float  # the fastest live worker's pace (0: none reported)


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
    # When the checkpoint holding this state was written (time.time()); None: not from a file.
    saved_at: float | None = None
    # An elastic job's members (worker -> the step it joined at) and rosters (step, members).
    members: dict[int, int] = field(default_factory=dict)
    rosters: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # Workers that had left (closed their client): they stay out of the quorum after a restore.
    left: list[int] = field(default_factory=list)


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
    left: frozenset[int] = frozenset()
    failure: str = ""
    # (event, seconds ago), oldest first: the newest MAX_EVENTS membership changes
    history: tuple[tuple[MembershipEvent, float], ...] = ()
    pending: frozenset[int] = frozenset()  # elastic: prepared joins
    membership_counts: dict[str, int] = field(default_factory=dict)  # kind -> changes
