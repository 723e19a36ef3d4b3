"""A shard: one job's agreement, worker clocks and membership, the consistency rule, and the
waits they impose, over the model state in ``pscore.variables``.

``Shard`` composes parts that each own their state, all guarded by its one condition variable:
the ``JobAgreement``, the ``Variables``, the ``Progress`` clocks, the ``Roster`` of workers,
the elastic ``Joins``, the ``CheckpointMarks`` and the ``OptimizerSide``. It is the only class
the servicers call. Plain Python: no grpc here. The servicer decodes requests into calls on
``Shard`` and encodes what comes back; every error is a ``PSError`` whose status the servicer
sends.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pscore.job import OBSERVER, Job
from pscore.tables import RowSparse, rows_from_file
from pscore.variables import Variables
from psserver.agreement import JobAgreement
from psserver.consistency import ConsistencyPolicy, make_policy
from psserver.consistency.asynchronous import AsyncPolicy
from psserver.consistency.sync import SyncPolicy
from psserver.elastic import PHASES, JoinResult, Joins, MembersView
from psserver.marks import CheckpointMarks
from psserver.observer import Observer, observed
from psserver.paces import Paces
from psserver.pipeline import CHAIN_WAIT_S, AsyncChain, Preview
from psserver.progress import Progress
from psserver.records import Beat, Limits, PushResult, Registration, ShardState, ShardStatus
from psserver.roster import Roster
from psserver.shard_optim import NO_OPTIONS, OptimizerSide, StepOptions
from pswire.errors import (
    CallCancelledError,
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    PSError,
    ShardRestartedError,
    StepRefusedError,
    TooLargeError,
    UnavailableError,
    WaitTimeoutError,
)
from pswire.optstate import state_arrays

# No step is ever this large: a clock past it would overflow the wire's int64.
MAX_STEP = 1 << 62
# How often a wait for a push's turn asks whether its caller went away (a Flight call
# cannot wake the shard when it is cancelled).
TURN_TICK_S = 0.1
# A caller going away: an event set (and ``wake`` called) when it does (grpcio), or a question
# every wait asks at least once a second (a Flight call, which cannot wake the shard).
Cancelled = threading.Event | Callable[[], bool]


class Shard:
    """One parameter-server shard; thread-safe, every wait bounded.

    ``clock`` (seconds, monotonic) is what membership reads: tests inject one and call
    ``expire_silent`` to drop workers without sleeping.
    """

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or Limits()
        self.incarnation = uuid.uuid4().hex[:12]
        self.checkpointing = False  # set by the CheckpointScheduler that saves this shard
        self.observer: Observer | None = None  # set by the server when metrics are on
        self._now = clock
        self._cond = threading.Condition()
        self._policy: ConsistencyPolicy | None = None
        self._ready = False  # initial values installed
        self._failure = ""  # a refused sync step: every later step fails with it
        self._closed = False
        self._before_change: set[Callable[[], None]] = set()  # live replies (steady_reader)
        self._changes = 0  # how often the values changed in place or were replaced
        self.predicted_rounds = 0  # steps whose pipelined predictions were installed
        self._previews: dict[int, Preview] = {}  # the open sync round's (psserver/pipeline.py)
        self._chain = AsyncChain()  # async pushes predicted while they arrive
        # The last update's hyper-parameters and skip, as applied (what a preview assumed).
        self._last_applied: tuple[Any, bool] = ((), False)
        self._paces = Paces()  # DiLoCo's dynamic local steps: soft state, not checkpointed
        progress = Progress()
        self._compose(
            JobAgreement(),
            Variables(),
            progress,
            Roster(self.limits, clock, progress),
            CheckpointMarks(clock),
            None,
        )

    def _compose(
        self,
        agreement: JobAgreement,
        state: Variables,
        progress: Progress,
        roster: Roster,
        marks: CheckpointMarks,
        job: Job | None,
    ) -> None:
        """Installs the shard's parts (lock held, or before serving), wired to each other."""
        self._changes += 1  # values replaced wholesale: no preview holds across it
        self._agreement = agreement
        self._state = state
        self._progress = progress
        self._roster = roster
        self._joins = Joins(roster, progress, self.limits.max_step_ahead, self._membership_changed)
        self._marks = marks
        self._optim = OptimizerSide(job)

    @property
    def _job(self) -> Job | None:
        return self._agreement.job

    @property
    def job_id(self) -> str:
        """The id of the job this shard holds ("" before any)."""
        job = self._agreement.job
        return job.job_id if job is not None else ""

    def close(self) -> None:
        """The shard is stopping: every wait ends now, and new calls that would wait fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes every wait to look again (a call was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    def init(
        self,
        worker_id: int,
        job: Job,
        values: Mapping[str, np.ndarray] | None,
        take: bool = False,
    ) -> bool:
        """Agrees on the job (worker 0's: see ``JobAgreement``); installs initial values if none
        are held yet. Returns whether ``values`` were installed (``job_id`` says which job the
        shard holds now).

        Values are not installed when the shard already has some: a restarted or later worker
        never overwrites trained weights. ``take``: the caller hands the arrays over (nothing
        else refers to them), so writable ones of the right dtype are kept as they are.

        Raises:
            InvalidRequestError: bad job description or values.
            ModelMismatchError: the job differs from worker 0's, which the shard holds.
            TooLargeError: over the shard's limits (variables, memory).
        """
        self._check_job(worker_id, job)
        if values is not None:
            job.check_values(values)
        # Tables are made (and their rows drawn) outside the lock: a large one takes seconds,
        # and status and health must not wait for it.
        if values is not None and worker_id != 0:
            raise InvalidRequestError(
                f"init from worker {worker_id} carries initial values: only worker 0 sends them"
            )
        state = Variables()
        if values is not None and not self._ready:  # unlocked peek: a waste at worst
            self._check_table_files(job)
            state.install(job, values, take)
        with self._cond:
            started = self._progress.finished_by(worker_id) > 0  # a restart, not a newcomer
            if self._agreement.declare(worker_id, job, started=started):
                self._set_job(job)
            self._touch(worker_id)
            self._optim.forget_load(worker_id)
            if values is None or self._ready:
                return False
            self._state = state
            self._changes += 1
            self._ready = True
            self._cond.notify_all()
            return True

    def check_init(self, worker_id: int, job: Job) -> None:
        """Raises what ``init`` of ``job`` would, for all that does not depend on the values,
        changing nothing: worker 0 asks every shard before any takes the job, so a table file
        that one shard cannot read leaves no shard holding the job. A shard that holds values
        already makes no table at init, so it reads no file here either.

        Raises:
            InvalidRequestError: bad job description, or a table's file (``init_from``) that
                cannot be its rows here.
            TooLargeError: over the shard's limits.
        """
        self._check_job(worker_id, job)
        if self._ready:  # unlocked peek: init would install nothing
            return
        self._check_table_files(job)
        for key, spec in job.specs.items():
            if spec.table is not None and spec.table.init_from:
                optimizer = job.optimizer_of(key)
                spec.table.check(optimizer)
                rows_from_file(spec.table, job.shard, job.num_shards, optimizer)

    def _check_table_files(self, job: Job) -> None:
        """Raises InvalidRequestError for a table file outside ``limits.table_files``."""
        folder = Path(self.limits.table_files).resolve()
        for key, spec in job.specs.items():
            path = spec.table.init_from if spec.table is not None else ""
            if path and not Path(path).resolve().is_relative_to(folder):
                raise InvalidRequestError(
                    f"table '{key}': init_from {path!r} is outside the folder this "
                    f"shard reads table files from, {str(folder)!r} (psserver --table-files)"
                )

    def _check_job(self, worker_id: int, job: Job) -> None:
        limits = self.limits
        job.check(limits.max_workers, limits.max_variables, limits.memory_limit_bytes)
        self._check_worker(worker_id, job.num_workers, "init")

    def _set_job(self, job: Job) -> None:
        self._policy = make_policy(job.mode, job.staleness, job.quorum)
        self._roster.start(job)
        self._optim = OptimizerSide(job)

    def pull(
        self,
        worker_id: int,
        step: int,
        names: Sequence[str] = (),
        timeout: float | None = None,
        encode: Callable[[Mapping[str, np.ndarray], int], Any] | None = None,
        rows: Sequence[tuple[str, np.ndarray | None]] = (),
        incarnation: str = "",
        cancelled: Cancelled | None = None,
        slots: frozenset[str] = frozenset(),
    ) -> tuple[Any, int]:
        """Snapshot of the variables once the consistency rule lets a worker at ``step`` read.

        ``rows``: (table, ids) pairs; each table's rows come back under its name, in id order
        (a dynamic table makes rows on first touch). Ids None: every row this shard holds of
        a dynamic table, as ``RowSparse`` (``psctl export``). Empty ``names`` means every
        variable that is not a table, or none when ``rows`` are asked for. ``slots``: tables
        of ``rows`` whose rows' optimizer state comes back too, in the same order, named as
        ``PullState`` names it (``pswire.optstate.slot_name``; ``psctl export``).

        Returns (copies of the variables, the clock). With ``encode``, returns
        ``encode(variables, clock)`` instead, called with the live arrays under the shard's lock:
        whatever it builds from them (the reply's bytes) is the snapshot, with no second copy.
        ``encode`` must not keep the arrays. ``worker_id`` ``OBSERVER`` (-1) reads without
        counting as any worker (psctl export). ``cancelled`` set (and ``wake`` called) ends
        the wait: the caller has gone.

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError: a worker id outside the job, or a step out of range.
            UnknownVariableError: a name the shard does not hold.
            ModelMismatchError: this worker declared another job than worker 0's.
            WaitTimeoutError: the rule or the initial values did not allow reading in time.
            StepRefusedError: the shard refused a step it could not apply.
            UnavailableError, CallCancelledError: the shard is stopping; the caller went away.
        """
        with observed(self.observer, "Pull"):
            job = self._check_call(worker_id, step, incarnation, "pull", reader=True)
            keys = job.pull_keys(names, rows)
            asked = dict(rows)
            alone = sorted(slots - asked.keys())
            if alone:
                raise InvalidRequestError(
                    f"table '{alone[0]}': its rows' optimizer state is asked for without its rows"
                )
            with self._cond:
                self._touch(worker_id)
                self._wait_agreed(worker_id, timeout, cancelled)
                policy = self._require_policy()
                self._wait(
                    lambda: (
                        policy.read_ready(self._roster.clocks(), step)
                        and policy.admits(self._roster.clocks(), step)
                    ),
                    timeout,
                    cancelled,
                    lambda: (
                        f"pull by worker {worker_id}: " + self._roster.waiting_for(policy, step)
                    ),
                )
                if worker_id != OBSERVER:
                    self._roster.open(step)
                # Gathering copies the rows: they are this pull's snapshot either way.
                tables = self._state.tables
                # Arrays, or a dynamic table's every row with their ids (RowSparse): psctl
                # export's pull, whose encode (the servicer's _messages) writes both.
                gathered: dict[str, Any] = {
                    table: tables[table].held() if ids is None else tables[table].gather(ids)
                    for table, ids in rows
                }
                for table in slots:
                    gathered.update(state_arrays({table: tables[table].state_of(asked[table])}))
                arrays = {**{k: self._state.values[k] for k in keys}, **gathered}
                if self.observer is not None:
                    self.observer.pulled(arrays)
                clock = self._progress.updates
                if encode is not None:
                    return encode(arrays, clock), clock
                snapshot = {k: a if k in gathered else a.copy() for k, a in arrays.items()}
                return snapshot, clock

    def steady_reader(
        self, before_change: Callable[[], None]
    ) -> tuple[Callable[[Callable[[], Any]], Any], Callable[[], None]]:
        """Called from a pull's ``encode`` (lock held), so a reply is written from the live
        arrays a piece at a time instead of a whole copy: (``read``, ``release``).

        ``read(copy)`` runs ``copy()`` (a copy of a piece) under the shard's lock. The shard
        calls ``before_change()`` (lock held) once, before it next changes the values in place
        (an update, a loaded state): the reply then copies what it has not sent yet, so it
        stays one step's values (copy on write). ``release()`` (the reply written or failed)
        ends the registration. In sync a step's values stay until every member pushed the next
        step, so ``before_change`` seldom runs; in async it runs when another push lands.
        """
        self._before_change.add(before_change)

        def read(copy: Callable[[], Any]) -> Any:
            with self._cond:
                return copy()

        def release() -> None:
            with self._cond:
                self._before_change.discard(before_change)

        return read, release

    def _changing(self) -> None:
        """The values are about to change in place (lock held): live replies copy first."""
        self._changes += 1
        hooks, self._before_change = self._before_change, set()
        for hook in hooks:
            hook()

    def push(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray | RowSparse],
        timeout: float | None = None,
        incarnation: str = "",
        take: bool = False,
        session: str = "",
        cancelled: Cancelled | None = None,
        options: StepOptions = NO_OPTIONS,
    ) -> PushResult:
        """Takes one worker's gradients (and ``options``) for one step, as the rule says.

        ``take``: the arrays were decoded for this call alone and may be changed (the
        servicer's); sync mode then sums a step's pushes into one of them instead of a copy.

        A push is applied at most once per (worker, step): a duplicate is acknowledged with
        ``applied=False, reason="duplicate"``; in ``sync`` a push for a step that already
        closed without it is dropped with ``reason="late"`` (and counted). A step may be at
        most ``limits.max_step_ahead`` beyond the one the shard expects from this worker.
        Nothing changes unless every gradient is valid, and no step whose result would not
        be finite is applied.

        Gradients of float32 variables may arrive as float16 or bfloat16 (the client's wire
        compression); they are widened to float32 before anything else.

        Raises:
            NotInitializedError: no job yet.
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: bad gradients, step
                or options.
            ModelMismatchError: this worker declared another job than worker 0's.
            HyperParameterMismatchError: sync, and another push of the step had other values.
            DuplicateWorkerError: another process holds this worker id now.
            WaitTimeoutError: the rule did not let the push in within the deadline.
            StepRefusedError: the step's result would not be finite (nothing applied).
            UnavailableError, CallCancelledError: the shard is stopping; the caller went away.
        """
        with observed(self.observer, "Push", grads):
            job = self._check_call(worker_id, step, incarnation, "push")
            squares: dict[str, float] = {}  # what the checks measured: the step reuses them
            grads = job.checked_grads(grads, squares)
            optimizers = job.step_optimizers(options)
            with self._cond:
                self._roster.members.check(worker_id, session)
                self._roster.check_member(worker_id, step)
                self._touch(worker_id)
                self._wait_agreed(worker_id, timeout, cancelled)
                if self._job is not job:  # worker 0 set a restored job's hyper-parameters
                    optimizers = self._require_job().step_optimizers(options)
                policy = self._require_policy()
                self._check_ahead(policy, worker_id, step)
                skipped = self._skip(policy, worker_id, step)
                if skipped is not None:
                    return skipped
                self._wait(
                    lambda: (
                        policy.push_ready(self._roster.clocks(), worker_id, step)
                        and policy.admits(self._roster.clocks(), step)
                    ),
                    timeout,
                    cancelled,
                    lambda: (
                        f"push by worker {worker_id}: " + self._roster.waiting_for(policy, step)
                    ),
                )
                # The wait released the lock: a retry of this push may have landed meanwhile.
                skipped = self._skip(policy, worker_id, step)
                if skipped is not None:
                    return skipped
                chained = self._chain.of(worker_id, step)
                if chained is not None and not self._chain.ready(chained):
                    # Its predictions build on the async push begun before it: applied after.
                    with contextlib.suppress(WaitTimeoutError):
                        self._wait(
                            lambda: self._chain.ready(chained),
                            CHAIN_WAIT_S if timeout is None else min(timeout, CHAIN_WAIT_S),
                            cancelled,
                            lambda: f"the push begun before worker {worker_id}'s step {step}",
                        )
                    skipped = self._skip(policy, worker_id, step)
                    if skipped is not None:
                        return skipped
                self._optim.steps.take(worker_id, step, optimizers, options.skip)
                self._roster.open(step)
                preview = self._previews.get(step)
                if preview is not None and preview.fed_by(worker_id):
                    assert isinstance(policy, SyncPolicy)  # only sync rounds are predicted
                    policy.defer(worker_id)  # the preview reads its arrays until the close
                update = policy.submit(self._roster.clocks(), worker_id, step, grads, owned=take)
                if update is not None:
                    # The push itself (applied on arrival, not summed into a round): its
                    # gradients were measured by its checks, and are not read again.
                    known = squares if update is grads else None
                    sync_round = policy.name == "sync"
                    self._apply(update, sync_round, known, chained)
                self._progress.reach(worker_id, step + 1)
                self._progress.counters["applied"] += 1
                self._capture_due()
                self._cond.notify_all()
                return self._result(True, "", worker_id, step)

    def wait_turn(
        self,
        worker_id: int,
        step: int,
        timeout: float | None = None,
        incarnation: str = "",
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Returns once ``worker_id``'s push for ``step`` would be taken without being held
        (``ConsistencyPolicy.turn``; in sync with three members or more: every lower worker
        of the open round has pushed): a front end calls it before it reads a whole push's
        bytes, so a round holds one push being read at a time instead of every worker's
        (bench/NOTES.md 27; a push streamed from backward is read as it arrives). At once
        for any other rule, and for a call the push itself will refuse.

        ``cancelled``: asked every ``TURN_TICK_S`` while waiting (the caller gone: stop).

        Raises:
            WaitTimeoutError, StepRefusedError, UnavailableError, CallCancelledError: as
                ``push``'s wait.
        """
        with self._cond:
            job, policy = self._job, self._policy
            if job is None or policy is None or not 0 <= worker_id < job.num_workers:
                return  # the push refuses it, with the message it gives
            if incarnation and incarnation != self.incarnation:
                return
            self._wait(
                lambda: policy.turn(self._roster.clocks(), worker_id, step),
                timeout,
                cancelled,
                lambda: (
                    f"its turn: push by worker {worker_id} for step {step} is read once every "
                    f"lower worker pushed; " + self._roster.waiting_for(policy, step)
                ),
                TURN_TICK_S,
            )

    def push_pull(
        self,
        worker_id: int,
        step: int,
        grads: Mapping[str, np.ndarray | RowSparse],
        encode: Callable[[Mapping[str, np.ndarray], int], Any],
        timeout: float | None = None,
        incarnation: str = "",
        take: bool = False,
        session: str = "",
        cancelled: Cancelled | None = None,
        options: StepOptions = NO_OPTIONS,
        rows: Sequence[tuple[str, np.ndarray]] = (),
    ) -> tuple[PushResult, Any, int]:
        """``push``, then ``pull`` of every variable that is not a table, and of ``rows``
        ((table, ids) pairs: the next batch's rows), at the step the worker goes on to
        (``PushResult.next_step``): (the push's result, the snapshot, the clock read at).

        Raises:
            as ``push`` and ``pull``.
        """
        result = self.push(
            worker_id, step, grads, timeout, incarnation, take, session, cancelled, options
        )
        # With rows, a pull reads only what it names: name every dense variable too.
        names = self._require_job().pull_keys((), ()) if rows else ()
        snapshot, clock = self.pull(
            worker_id,
            result.next_step,
            names,
            timeout=timeout,
            encode=encode,
            rows=rows,
            incarnation=incarnation,
            cancelled=cancelled,
        )
        with self._cond:  # who was missing by the time the step could be read
            result.absent = self._roster.absent(self._agreement.job)
        result.skipped = options.skip or self.step_skipped(step)
        return result, snapshot, clock

    def preview(
        self,
        worker_id: int,
        step: int,
        keys: Sequence[str],
        options: StepOptions = NO_OPTIONS,
        incarnation: str = "",
        session: str = "",
        make: bool = True,
    ) -> Preview | None:
        """The ``Preview`` (psserver/pipeline.py) joined by ``worker_id``'s push of ``step``
        carrying ``keys``: in sync, the open round's, shared by its workers' pushes; in
        async, one of its own, after the pushes that began before it (``AsyncChain``). None
        where no prediction can hold, and the push goes as without one (another rule, sync
        with a quorum, an elastic job, a sync step that is not the open round's, a step this
        worker already pushed, a push that skips its update, keys other than every dense
        variable of this shard, a worker id another process holds). ``make`` False: only an
        existing sync preview (a push sent whole feeds one that pipelined pushes made).
        """
        with self._cond:
            if not make and step not in self._previews:
                return None  # the common case of a push sent whole: nothing to feed
            job, policy = self._job, self._policy
            sync = isinstance(policy, SyncPolicy) and not policy.quorum
            if (
                job is None
                or not ((sync and step == self._progress.updates) or type(policy) is AsyncPolicy)
                or self._failure
                or options.skip
                or (incarnation and incarnation != self.incarnation)
                or not 0 <= worker_id < job.num_workers
            ):
                return None
            assert policy is not None
            clocks = self._roster.clocks()
            if clocks.joined or policy.classify(clocks, worker_id, step) is not None:
                return None
            if sorted(keys) != sorted(job.pull_keys((), ())):
                return None
            try:
                self._roster.members.check(worker_id, session)
                optimizers = job.step_optimizers(options)
            except PSError:
                return None  # the push refuses it, with the message it gives
            if not sync:
                updates = self._progress.updates
                base = self._preview_base(lambda: True)
                return self._chain.join(worker_id, step, updates, keys, job, optimizers, base)
            made = self._previews.get(step)
            if made is None:
                made = Preview(
                    step,
                    sorted(clocks.live),
                    keys,
                    job,
                    optimizers,
                    self._preview_base(lambda: self._progress.updates == step),
                )
                self._previews = {step: made}  # an older round's is done with
            if worker_id not in made.workers or not made.join(worker_id):
                return None
            return made

    def _preview_base(
        self, still: Callable[[], bool]
    ) -> Callable[[list[str]], tuple[Variables, int] | None]:
        """Copies of the values (and the change count) a preview starts from, while
        ``still()`` (lock held) says they are the ones it predicts from."""

        def base(keys: list[str]) -> tuple[Variables, int] | None:
            with self._cond:
                if not still() or self._failure:
                    return None
                return self._state.shadow(keys), self._changes

        return base

    def preview_held(self, preview: Preview) -> bool:
        """(lock held: a pull's ``encode``) Whether ``preview``'s values are the step's, now
        that it is applied: a sync round's (``Preview.held``), or an async push's predictions
        installed as it was applied."""
        if not isinstance(self._policy, SyncPolicy):
            return preview.installed
        closed_with = self._policy.last_closed
        return preview.held(self._changes, closed_with, self._progress.updates, self._last_applied)

    def preview_done(self, preview: Preview) -> None:
        """``preview``'s call ended: an async push that never reached ``push`` (cancelled,
        refused) is given up, and the pushes predicted after it with it."""
        if preview.private:  # a sync round's: no push is predicted after it
            return
        with self._cond:
            self._chain.resolve(preview, False, self._changes)

    def _predicted(self, preview: Preview, update: Mapping[str, Any]) -> bool:
        """(lock held, in ``_apply``: the values counted as changing, the clock not advanced
        yet) Whether ``preview`` made the step ``update`` is about to make: then its results
        are installed instead of computed again. An async push's own preview is found by its
        worker and step (``AsyncChain.of``)."""
        if isinstance(self._policy, SyncPolicy):
            closed_with = self._policy.last_closed
        else:
            closed_with = preview.workers
        return sorted(update) == sorted(preview.keys) and preview.held(
            self._changes,
            closed_with,
            self._progress.updates + 1,
            self._last_applied,
            self._chain.installed,
        )

    def register_worker(self, worker_id: int, num_workers: int, session: str = "") -> Registration:
        """Records a worker (new, restarted or reconnecting); says where it (re)joins.

        In an elastic job only a member resumes; another worker joins (``Shard.join``) and is
        told the earliest step it could join at. A new process taking over a member's id ends
        that membership ("replaced"): the new one joins afresh.

        Raises:
            InvalidRequestError: ids out of range.
            TooLargeError: more workers than the shard's limit.
            ModelMismatchError: ``num_workers`` differs from the job's.
            DuplicateWorkerError: another live process holds this worker id.
        """
        if num_workers < 1 or not 0 <= worker_id < num_workers:
            raise InvalidRequestError(
                f"worker_id {worker_id} must be in [0, num_workers) with num_workers >= 1, "
                f"got num_workers {num_workers}"
            )
        if num_workers > self.limits.max_workers:
            raise TooLargeError(
                f"num_workers {num_workers} is over this shard's limit of {self.limits.max_workers}"
            )
        with self._cond:
            job = self._agreement.job
            if job is not None and job.num_workers != num_workers:
                raise ModelMismatchError(
                    f"worker {worker_id} says num_workers {num_workers}; the job on this shard "
                    f"has {job.num_workers}"
                )
            roster, progress = self._roster, self._progress
            members = roster.members
            holder = members.holder(worker_id)
            members.claim(worker_id, session, self._now())
            member = worker_id in members.live_view
            if members.elastic and member and holder not in (None, session):
                members.drop(worker_id)
                roster.record(progress.finished_by(worker_id), worker_id, "replaced")
                self._membership_changed()
                member = False
            self._touch(worker_id)
            if members.elastic and not member and self._policy is not None:
                clock = self._policy.join_step(roster.clocks(), worker_id)
                return Registration(clock, self._ready, 0, job.job_id if job else "")
            if self._policy is not None:
                # A worker that fell behind (dropped, restarted) resumes at the current step.
                progress.reach(worker_id, self._policy.join_clock(roster.clocks(), worker_id))
            return Registration(
                progress.finished_by(worker_id),
                self._ready,
                self._marks.durable_step(worker_id),
                job.job_id if job is not None else "",
            )

    def heartbeat(self, worker_id: int, session: str = "") -> int:
        """Marks a worker alive; returns the steps it has finished here (``beat().clock``).

        Raises:
            As ``beat``.
        """
        return self.beat(worker_id, session).clock

    def beat(self, worker_id: int, session: str = "", seconds_per_step: float = 0.0) -> Beat:
        """Marks a worker alive and keeps its pace (``seconds_per_step`` per inner step, 0:
        unchanged; DiLoCo's dynamic local steps); returns the steps it has finished here and
        the fastest pace of a live worker.

        Raises:
            InvalidRequestError: an id outside the job's workers (before a job: the limit), or
                a pace that is not finite, negative or over a day (nothing is changed).
            DuplicateWorkerError: another process holds this worker id now.
        """
        with self._cond:
            job = self._agreement.job
            self._check_worker(
                worker_id, job.num_workers if job else self.limits.max_workers, "heartbeat"
            )
            Paces.check(worker_id, seconds_per_step)
            self._roster.members.check(worker_id, session)
            self._touch(worker_id)
            self._paces.record(worker_id, seconds_per_step)
            return Beat(
                self._progress.finished_by(worker_id),
                self._paces.fastest(self._roster.members.live_view),
            )

    def leave(self, worker_id: int, session: str = "") -> None:
        """A worker leaves the job (its client closed): it no longer counts in the sync quorum
        or the ssp gate, and a round waiting only on it closes now.

        Raises:
            InvalidRequestError: an id outside the job's workers.
            DuplicateWorkerError: another process holds this worker id now.
        """
        with self._cond:
            job = self._agreement.job
            if job is None:
                return
            self._check_worker(worker_id, job.num_workers, "leave")
            members = self._roster.members
            members.check(worker_id, session)
            member = worker_id in members.live_view
            if members.leave(worker_id):
                if member:
                    self._roster.record(self._progress.finished_by(worker_id), worker_id, "left")
                self._membership_changed()

    def release(self, worker_id: int, session: str) -> None:
        """A worker whose init failed gives up its claim on its id (``Membership.release``):
        a corrected rerun need not wait out the claim's grace. Nothing else changes, the quorum
        included (a running job's member restarted with a wrong model is still awaited)."""
        with self._cond:
            self._roster.members.release(worker_id, session)

    def expire_silent(self) -> list[int]:
        """Drops workers silent past the heartbeat timeout (see ``Membership.expire``); a sync
        step waiting only on them closes now. The server calls this on a timer; reads
        (``status``, metrics) never do."""
        with self._cond:
            return self._expire()

    def join(self, worker_id: int, session: str, phase: str, step: int = 0) -> JoinResult:
        """One phase of an elastic join (see ``psserver.elastic``).

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError: the job is not elastic, a worker id not below its maximum of
                workers, an unknown phase, a worker that is a member already, a commit without
                a prepare at that step, or a step far ahead.
            DuplicateWorkerError: another process holds this worker id.
        """
        if phase not in PHASES:
            raise InvalidRequestError(f"join phase {phase!r}; expected one of {list(PHASES)}")
        with self._cond:
            self._elastic_job(worker_id)
            self._roster.members.check(worker_id, session)
            self._touch(worker_id)
            return self._joins.phase(worker_id, phase, step, self._require_policy())

    def list_members(
        self,
        worker_id: int,
        step: int,
        timeout: float | None = None,
        cancelled: Cancelled | None = None,
    ) -> MembersView:
        """The members that train at ``step`` (in sync: as the step opened), once a worker may
        read at it (this opens it), and the rosters before it.

        Raises:
            NotInitializedError, InvalidRequestError: no elastic job; a worker outside it.
            WaitTimeoutError: the step did not open in time (the message says what it lacks).
            UnavailableError, CallCancelledError: the shard is stopping; the caller went away.
        """
        with self._cond:
            job = self._elastic_job(worker_id, reader=True)
            policy = self._require_policy()
            self._touch(worker_id)
            self._wait(
                lambda: (
                    policy.read_ready(self._roster.clocks(), step)
                    and policy.admits(self._roster.clocks(), step)
                ),
                timeout,
                cancelled,
                lambda: f"members at step {step}: " + self._roster.waiting_for(policy, step),
            )
            self._roster.open(step)
            history = self._roster.history
            rosters = tuple((s, m) for s, m in history.rosters if s <= step)
            return MembersView(
                step,
                history.roster_at(step),
                rosters,
                job.min_workers,
                job.max_workers,
            )

    def step_skipped(self, step: int) -> bool:
        """sync: whether ``step`` closed with no optimizer update because a worker skipped it
        (its GradScaler found inf/NaN); otherwise False."""
        with self._cond:
            return self._optim.steps.skipped(step)

    def optimizer_state(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Copies of every trained variable's optimizer slots (slots not made yet, such as
        SGD's momentum buffer before the first step, left out).

        Raises:
            NotInitializedError: no job yet.
            WaitTimeoutError: no initial values within the deadline.
        """
        self._require_job()
        with self._cond:
            self._wait_values(timeout, None)
            return self._state.optimizer_state()

    def load_state(
        self,
        worker_id: int,
        digest: str,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        timeout: float | None = None,
    ) -> None:
        """Worker 0: its ``values`` and ``slots`` replace the shard's (every trained variable's
        slots; those not given start afresh). Another worker: waits for worker 0's load and
        checks that it loaded the same state (``digest``).

        Raises:
            NotInitializedError: no job yet.
            InvalidRequestError, UnknownVariableError: a bad state (nothing changed), or state
                sent by a worker other than 0.
            ModelMismatchError: this worker loaded another state than worker 0.
            WaitTimeoutError: worker 0 did not load within the deadline.
        """
        job = self._require_job()
        if worker_id != 0 and (values or slots):
            raise InvalidRequestError(
                f"worker {worker_id} sent optimizer state: only worker 0's is loaded (the "
                "others send the digest of theirs)"
            )
        with self._cond:
            self._wait_values(timeout, None)
            if worker_id == 0:
                self._changing()
                self._state.load(job, values or {}, slots)
                self._optim.loaded = digest
                self._cond.notify_all()
                return
            self._wait(
                lambda: self._optim.loaded is not None,
                timeout,
                None,
                lambda: f"worker 0 to load its optimizer state (worker {worker_id} has loaded)",
            )
            loaded = self._optim.loaded
            if loaded != digest:
                raise ModelMismatchError(
                    f"worker {worker_id} loaded another optimizer state than worker 0 (state "
                    f"digest {digest}, worker 0's {loaded}): load the same checkpoint on "
                    "every worker"
                )

    def capture_every(self, steps: int) -> None:
        """Copies the state for a checkpoint whenever the clock reaches a multiple of
        ``steps`` (0: never); ``take_captured`` hands the copy over."""
        with self._cond:
            self._marks.every = steps

    def take_captured(self) -> ShardState | None:
        """The newest state copied at a multiple of the capture interval, once; else None."""
        with self._cond:
            return self._marks.take()

    def status(self) -> ShardStatus:
        """What the shard holds and who it counts, read without changing anything."""
        with self._cond:
            now = self._now()
            progress, members, history = self._progress, self._roster.members, self._roster.history
            workers = {
                w: (progress.finished_by(w), members.seconds_since(w, now)) for w in members.known()
            }
            return ShardStatus(
                initialized=self._ready,
                job=self._agreement.job,
                clock=progress.updates,
                workers=workers,
                live=members.live,
                total_bytes=self._state.nbytes,
                pushes_applied=progress.counters["applied"],
                pushes_duplicate=progress.counters["duplicate"],
                pushes_late=progress.counters["late"],
                checkpoint_step=self._marks.step,
                checkpoint_age_s=self._marks.age_s(now),
                tables={
                    k: (t.rows, t.nbytes, t.evictions, t.spec.capacity)
                    for k, t in self._state.tables.items()
                },
                left=members.left,
                failure=self._failure,
                history=tuple((e, now - e.at) for e in history.events),
                pending=frozenset(members.pending),
                membership_counts=dict(history.counts),
            )

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of every variable (for tests and exports)."""
        with self._cond:
            return {k: v.copy() for k, v in self._state.values.items()}

    def export_state(self) -> ShardState | None:
        """A consistent copy of everything a checkpoint needs; None before initial values.

        Taken between updates, so a sync step is either wholly in it or not at all: pushes to
        the open step are left out (their workers' clocks say so) and get re-sent by the
        workers after a restart.
        """
        with self._cond:
            if not self._ready:
                return None
            job = self._agreement.job
            policy = self._policy
            assert job is not None and policy is not None
            progress, roster = self._progress, self._roster
            finished = {
                w: policy.durable_clock(progress.updates, f) for w, f in progress.finished.items()
            }
            variables, slots, tables = self._state.export()
            return ShardState(
                job=job,
                variables=variables,
                slots=slots,
                updates=progress.updates,
                finished=finished,
                counters=dict(progress.counters),
                tables=tables,
                members=dict(roster.members.joined),
                rosters=list(roster.history.rosters),
                left=sorted(roster.members.left),
            )

    def mark_checkpoint(self, state: ShardState) -> None:
        """Records that ``state`` is durable: workers may forget pushes it covers."""
        with self._cond:
            self._marks.mark(state)

    def restore(self, state: ShardState) -> None:
        """Becomes the shard that saved ``state`` (on a fresh shard, before serving): builds
        each part from it and installs them together.

        Raises:
            InvalidRequestError: the state does not match its own job.
        """
        job = state.job
        variables = Variables.restored(job, state.variables, state.slots, state.tables)
        progress = Progress.restored(state)
        with self._cond:
            roster = Roster.restored(state, self.limits, self._now, progress)
            marks = CheckpointMarks.restored(state, self._now, self._marks.every)
            self._policy = make_policy(job.mode, job.staleness, job.quorum)
            self._compose(JobAgreement.restored(job), variables, progress, roster, marks, job)
            self._ready = True
            self._cond.notify_all()

    def _check_call(
        self, worker_id: int, step: int, incarnation: str, what: str, reader: bool = False
    ) -> Job:
        """The checks every pull and push makes before touching anything; returns the job.

        Raises:
            ShardRestartedError, NotInitializedError, InvalidRequestError, StepRefusedError.
        """
        self._check_incarnation(incarnation, worker_id, what)
        job = self._require_job()
        if not (reader and worker_id == OBSERVER):
            self._check_worker(worker_id, job.num_workers, what)
        if step < 0:
            raise InvalidRequestError(f"{what} by worker {worker_id} has negative step {step}")
        if step >= MAX_STEP:
            raise InvalidRequestError(f"{what} by worker {worker_id} has step {step} >= 2**62")
        if self._failure:
            raise StepRefusedError(self._failure)
        return job

    def _check_ahead(self, policy: ConsistencyPolicy, worker_id: int, step: int) -> None:
        """Refuses a step past the one this worker is expected to push next (plus the slack).

        Raises:
            InvalidRequestError: naming the step, the expected one and the limit.
        """
        expected = self._progress.finished_by(worker_id)
        if policy.name == "sync":
            expected = max(expected, self._progress.updates)
        if step > expected + self.limits.max_step_ahead:
            raise InvalidRequestError(
                f"push by worker {worker_id} is for step {step}, but its next step here is "
                f"{expected} (at most {self.limits.max_step_ahead} ahead allowed: "
                "psserver --max-step-ahead); a step from the future would make this worker's "
                "real pushes look like retries"
            )

    def _skip(self, policy: ConsistencyPolicy, worker_id: int, step: int) -> PushResult | None:
        reason = policy.classify(self._roster.clocks(), worker_id, step)
        if reason is None:
            return None
        self._progress.counters[reason] += 1
        return self._result(False, reason, worker_id, step)

    def _result(self, applied: bool, reason: str, worker_id: int, step: int) -> PushResult:
        # After a late sync push the worker moves on to the step the shard is in.
        clock = self._progress.updates
        after = max(step + 1, clock) if reason == "late" else step + 1
        absent = self._roster.absent(self._agreement.job)
        durable = self._marks.durable_step(worker_id)
        return PushResult(applied, reason, clock, durable, after, absent, self.job_id)

    def _apply(
        self,
        update: Mapping[str, Any],
        sync_round: bool,
        known_squares: Mapping[str, float] | None = None,
        chained: Preview | None = None,
    ) -> None:
        """Applies an update (lock held). A sync round that cannot be applied has been consumed
        (its pushes are gone), so the refusal is kept: every later step fails with it.
        ``known_squares``: sums of squares of ``update``'s own arrays already measured
        (``Variables.apply``). ``chained``: an async push's preview (``AsyncChain``), whose
        predictions are installed where they hold.

        Raises:
            StepRefusedError: the update's result would not be finite; nothing applied.
        """
        optimizers, skip = self._optim.steps.pop(self._progress.updates)
        self._last_applied = (optimizers or self._require_job().optimizers, skip)
        preview = self._previews.get(self._progress.updates) if sync_round else chained
        self._previews = {}  # the round closes: its pushes hold its preview while they answer
        installed = False
        try:
            self._changing()
            if preview is not None and self._predicted(preview, update):
                # The pipelined replies made this very step already (psserver/pipeline.py).
                self._state.adopt(preview.predicted())
                self.predicted_rounds += 1
                installed = True
            else:
                self._state.apply(
                    self._require_job(),
                    update,
                    optimizers,
                    skip,
                    summed=sync_round,
                    known_squares=known_squares,
                )
        except StepRefusedError as exc:
            if sync_round:
                self._failure = (
                    f"step {self._progress.updates} was refused and not applied: {exc}; the "
                    "shard holds the weights from before it. Restart the job (from a "
                    "checkpoint) with a smaller learning rate or gradient scaling"
                )
                self._cond.notify_all()
                raise StepRefusedError(self._failure) from None
            raise
        finally:
            if chained is not None:
                self._chain.resolve(chained, installed, self._changes)
            elif not sync_round:
                self._chain.clear("a push sent whole changed the values first")
        self._progress.updates += 1

    def _membership_changed(self) -> None:
        """Re-evaluates the rule after workers left (lock held); a round may close now."""
        assert self._policy is not None
        update = self._policy.membership_changed(self._roster.clocks())
        if update is not None:
            # A refusal is kept as the shard's failure: every waiting call wakes to it.
            with contextlib.suppress(StepRefusedError):
                self._apply(update, sync_round=True)
            self._capture_due()
        self._cond.notify_all()

    def _touch(self, worker_id: int) -> None:
        """``worker_id`` was heard from (lock held): a worker back in the quorum wakes waits."""
        if self._roster.touch(worker_id):
            self._cond.notify_all()

    def _check_incarnation(self, seen: str, worker_id: int, what: str) -> None:
        """Refuses a call made for an earlier incarnation of this shard (before a restart):
        the worker must re-register and replay what the restart lost, not carry on.

        Raises:
            ShardRestartedError: ``seen`` is set and is not this shard's incarnation.
        """
        if seen and seen != self.incarnation:
            raise ShardRestartedError(
                f"{what} by worker {worker_id} was made for shard incarnation {seen}, but the "
                f"shard restarted (now {self.incarnation}): re-register and replay first"
            )

    def _expire(self) -> list[int]:
        """``Roster.expire``, the rule told (lock held)."""
        if self._policy is None:
            return []
        changed = self._roster.expire()
        if changed:
            self._membership_changed()
        return changed

    def _capture_due(self) -> None:
        """After an update (lock held): copies the state if the clock is at a multiple of the
        capture interval and no copy was taken at it yet."""
        updates = self._progress.updates
        if self._marks.due(updates):
            self._marks.keep(updates, self.export_state())

    def _elastic_job(self, worker_id: int, reader: bool = False) -> Job:
        job = self._require_job()
        if not job.elastic:
            raise InvalidRequestError(
                f"worker {worker_id}: this job is not elastic (it has a fixed {job.num_workers} "
                "workers); start every worker with elastic=MIN:MAX (psworker --elastic) to let "
                "workers join and leave"
            )
        if not (reader and worker_id == OBSERVER):
            self._check_worker(worker_id, job.num_workers, "join")
        return job

    def _wait_agreed(
        self, worker_id: int, timeout: float | None, cancelled: Cancelled | None
    ) -> None:
        """Waits for the initial values and, in a job restored from a checkpoint, for worker
        0's declaration when this worker declared other hyper-parameters (only worker 0 sets
        them: applying the checkpoint's meanwhile would be silently wrong); then refuses a
        worker whose declaration is not the job (lock held).

        Raises:
            ModelMismatchError: this worker declared another job than the shard's.
            WaitTimeoutError: worker 0 did not declare within the deadline.
        """
        self._wait_values(timeout, cancelled)
        if self._agreement.awaiting(worker_id):
            self._wait(
                lambda: not self._agreement.awaiting(worker_id),
                timeout,
                cancelled,
                lambda: (
                    f"worker 0's init: worker {worker_id} declared other hyper-parameters than "
                    "the job in this shard's checkpoint, and only worker 0 changes them"
                ),
            )
        self._agreement.check(worker_id)

    def _require_job(self) -> Job:
        job = self._job
        if job is None:
            raise NotInitializedError(
                "this shard holds no job yet: a worker must call init before pull or push"
            )
        return job

    def _check_worker(self, worker_id: int, num_workers: int, what: str) -> None:
        # Checked before any bookkeeping: an unknown id recorded as a member would join the
        # quorum, and a sync step would wait for a worker that does not exist.
        if not 0 <= worker_id < num_workers:
            raise InvalidRequestError(
                f"{what} from worker {worker_id}, but the job has workers 0..{num_workers - 1}"
            )

    def _require_policy(self) -> ConsistencyPolicy:
        assert self._policy is not None
        return self._policy

    def _wait_values(self, timeout: float | None, cancelled: Cancelled | None) -> None:
        self._wait(
            lambda: self._ready,
            timeout,
            cancelled,
            lambda: "initial values from the initialising worker (worker 0) never arrived",
        )

    def _wait(
        self,
        ready: Callable[[], bool],
        timeout: float | None,
        cancelled: Cancelled | None,
        describe: Callable[[], str],
        tick: float | None = None,
    ) -> None:
        """Waits (lock held) until ``ready()``, dropping silent workers meanwhile.

        ``cancelled``: an event set (and ``wake`` called) when the caller goes away, or a
        question asked at least every ``tick`` seconds (a front end that cannot wake the
        shard); ``tick`` None: often enough to notice a worker passing its heartbeat timeout.

        Raises:
            WaitTimeoutError: not ready within the deadline; the message says what was missing.
            StepRefusedError: the shard refused a step meanwhile.
            UnavailableError: the shard is stopping.
            CallCancelledError: the caller went away.
        """
        limit = self.limits.max_wait_s if timeout is None else min(timeout, self.limits.max_wait_s)
        deadline = time.monotonic() + max(0.0, limit)
        # Wake up often enough to notice a worker passing its heartbeat timeout.
        hb = self.limits.heartbeat_timeout_s
        every = min(1.0, hb / 4) if hb > 0 else 1.0
        tick = every if tick is None else min(tick, every)
        gone = cancelled.is_set if isinstance(cancelled, threading.Event) else cancelled
        while True:
            if self._failure:
                raise StepRefusedError(self._failure)
            if ready():
                return
            if self._closed:
                raise UnavailableError(f"the shard is stopping; was waiting for {describe()}")
            if gone is not None and gone():
                raise CallCancelledError(f"the caller went away while waiting for {describe()}")
            if self._expire():
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(f"gave up after {limit:.1f}s waiting for {describe()}")
            self._cond.wait(min(remaining, tick))
