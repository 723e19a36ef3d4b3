"""The numpy-level client: init, pull and push against every shard in parallel."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Self, TypeVar

import numpy as np

from pscore.job import FIXED_MARK, Job, fixed_digest
from pscore.optim import Optimizer
from pscore.optspec import StepOptions, resolve_groups
from pscore.tables import RowSparse, Table
from pswire.errors import (
    ConfigError,
    InvalidRequestError,
    PSError,
    WorkerDroppedError,
    not_in_model,
)
from pswire.jobspec import job_to_proto
from pswire.piecekey import check_names
from pswire.proto import ps_pb2
from pswire.write import encode_chunk_messages
from psworker.client_state import ModelState, Slots
from psworker.fanout import partial_failure
from psworker.link import ShardLink, shard_status
from psworker.outgoing import check_shards_agree, shard_jobs, split_push
from psworker.placement import ShardMap, TableLayout, VarInfo, copy_in, plan, tables_digest
from psworker.push_stream import StepStreams
from psworker.session import (
    AbsentWorkers,
    Heartbeats,
    JobIdentity,
    leave_at_exit,
    say_resumed,
)
from psworker.settings import ClientSettings
from psworker.shards import Shards
from psworker.stall import StallWatch, shard_statuses
from psworker.tables_client import RowReads, into_with_rows, place_rows

T = TypeVar("T")
log = logging.getLogger(__name__)


class PSClient:
    """A worker's connection to the parameter-server shards of one job, built from its
    ``ClientSettings`` (``connect()`` makes them from arguments and ``PS_*`` variables).

    Every call fans out to all shards in parallel and has a deadline (``settings.timeout``
    seconds); a failure raises a ``PSError`` subclass whose ``.code`` is the gRPC status.
    ``settings.security`` (TLS files, token) applies to every shard.

    Its parts: ``shards`` (the links, the fan-out over them, the model's placement), handed to
    the model-state calls (``optimizer_state``, ``load_state``) and the table-row reads
    (``pull_rows``); the steps themselves are this class's.

    Raises:
        ConfigError: elastic settings (``min_workers``/``max_workers``) given to a plain
            ``PSClient``: an elastic job's workers are ``ElasticPSClient``.
    """

    # Whether this class joins elastic jobs: settings for one and a class for the other
    # would register a job no worker joins the way it expects.
    _elastic_job = False

    def __init__(self, settings: ClientSettings) -> None:
        if settings.elastic != self._elastic_job:
            raise ConfigError(
                f"settings of an elastic job (min_workers={settings.min_workers}, max_workers="
                f"{settings.max_workers}) need ElasticPSClient (connect(elastic=...))"
                if settings.elastic
                else "ElasticPSClient needs the settings of an elastic job: min_workers and "
                "max_workers (connect(elastic='MIN:MAX'))"
            )
        self.settings = settings
        self.addresses = list(settings.addresses)
        self.worker_id = settings.worker_id
        self.num_workers = settings.num_workers
        self.mode = settings.mode
        self.staleness = settings.staleness
        self.chunk_bytes = settings.chunk_bytes
        self.split_bytes = settings.split_bytes
        self.part_bytes = settings.part_bytes
        self.step = 0
        self.last_skipped = False  # the step last pushed had no optimizer update
        self.quorum = settings.quorum
        self.min_workers, self.max_workers = settings.min_workers, settings.max_workers
        self.compression = settings.compression
        # What else the job's workers must agree on beyond the model (e.g. DiLoCo's local steps
        # and inner optimizer, psworker/diloco.py): part of the model digest init declares.
        self.variant = ""
        self._buffers: set[str] = set()
        self.heartbeat_s = settings.heartbeat_s
        self.security = settings.security
        # This process's id: a second process claiming the same worker id is refused.
        self.session = uuid.uuid4().hex[:12]
        self.identity = JobIdentity(settings.job_id)
        self.shards = Shards(settings, self.session, self.identity)
        self._state = ModelState(self.shards, self.worker_id, self.chunk_bytes)
        self._rows = RowReads(self.shards, self.worker_id)
        self._absent = AbsentWorkers(self.worker_id)
        self._beats = Heartbeats(self.links, self.heartbeat_s, self.worker_id, self.session)
        probe = partial(shard_statuses, self.links)
        self._stall = StallWatch(
            settings.stall_warning_s, self.worker_id, probe, self.mode, self.staleness
        )
        # What must finish before the client leaves: an overlapped step still landing.
        self._before_close: list[Callable[[], None]] = []
        leave_at_exit(self)

    @property
    def timeout(self) -> float:
        """Every call's deadline in seconds (``connect(timeout=...)``)."""
        return self.settings.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        # Each link and transport was built with the deadline; a new one set here would reach
        # some calls and not others.
        raise AttributeError(
            f"a client's timeout is fixed when it connects (now {self.settings.timeout:g}s): "
            f"connect(timeout={value!r}) instead of setting client.timeout"
        )

    @property
    def links(self) -> list[ShardLink]:
        """Each shard's link, in address order."""
        return self.shards.links

    @property
    def shard_map(self) -> ShardMap | None:
        """Where the model's variables lie (None before ``init``)."""
        return self.shards.shard_map

    @property
    def tables(self) -> dict[str, TableLayout]:
        """Where each embedding table's rows lie (empty before ``init``)."""
        return self.shards.tables

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self.shards.closed

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif exc[0] is KeyboardInterrupt:  # Ctrl-C: leave now, waiting for nothing in flight
            self._before_close.clear()
            self.close()
        else:
            try:  # the block's own error is the one to see; a step that failed to land is logged
                self.close()
            except PSError as e:
                log.warning("worker %d: closing after %r: %s", self.worker_id, exc[1], e)

    def close(self) -> None:
        """Leaves the job (the shards stop counting this worker in the sync quorum and the ssp
        gate), stops heartbeats and closes the channels; the client is unusable afterwards.
        A step still in flight (``overlap=True`` returns before its reply) lands first.

        Raises:
            PSError: that step failed (the client is closed all the same).
        """
        if self.shards.closed:
            return
        try:
            for land in self._before_close:
                land()
        finally:
            self._beats.stop()
            self._stall.close()
            self.shards.close()

    def before_close(self, land: Callable[[], None]) -> None:
        """Has ``close()`` call ``land`` first (an overlapped step's replies still landing),
        so no step this worker began is cut off by its own close."""
        self._before_close.append(land)

    # -- API --------------------------------------------------------------------------------

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer | Sequence[Optimizer],
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
        fixed: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Agrees on the job with every shard; worker 0 sends the initial values.

        ``optimizer``: one, or one per parameter group (any classes); ``groups`` gives a
        variable's or table's group (index into them; 0 when absent).

        Every worker passes the same model (names, shapes, dtypes); worker 0's values become
        the starting weights, other workers' are not sent. A worker that restarts resumes at
        the step the shards recorded for it. Variables named in ``buffers`` are not trained:
        pushes carry their values, and the shards keep the pushed values (in ``sync`` mode
        their mean over the step's workers). ``tables`` are embedding tables, split by rows
        across every shard and initialised there (never sent): read them with ``pull_rows``,
        train them with ``RowSparse`` gradients in ``push``. ``fixed``: arrays never trained
        nor sent (a model's parameters in no optimizer group) that every worker must hold
        alike: their digest is part of the model's, so a worker whose differ is refused.

        Raises:
            ModelMismatchError: a shard holds a different model, mode or optimizer, or other
                ``fixed`` values than worker 0's.
            PSError: any other failure, with its gRPC status on ``.code``.
        """
        arrays = {name: np.asarray(v) for name, v in variables.items()}
        infos = [VarInfo(n, tuple(a.shape), a.dtype.name) for n, a in arrays.items()]
        tables = dict(tables or {})
        clash = sorted(set(tables) & set(arrays))
        if clash:
            raise InvalidRequestError(f"names used by both a variable and a table: {clash}")
        try:
            check_names(tables, "table")
            shard_map = plan(infos, len(self.shards), self.split_bytes, self.part_bytes)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        layouts = {n: TableLayout.build(n, t, len(self.shards)) for n, t in tables.items()}
        digest = shard_map.digest()
        if tables:  # a model without tables keeps the digest it always had
            digest = hashlib.sha256((digest + tables_digest(tables)).encode()).hexdigest()[:16]
        if fixed:
            digest += FIXED_MARK + fixed_digest(fixed)
        digest += self.variant
        send_values = self.worker_id == 0
        pieces = shard_map.split(arrays)
        self._buffers = set(buffers)
        optimizers, group = resolve_groups(optimizer, groups, [*arrays, *tables])

        def register(shard: int) -> ps_pb2.RegisterWorkerResponse:
            link = self.links[shard]
            reply = link.call("RegisterWorker", lambda _: link.register())
            link.incarnation = reply.incarnation
            return reply

        registered = self._fan_out(register)
        if send_values:
            check_shards_agree(registered, self.addresses)
        # Worker 0 proposes the job's identity; a shard that already holds a job keeps its own.
        proposed = self.identity.value or (uuid.uuid4().hex[:16] if send_values else "")
        job = Job(
            self.mode,
            self.staleness,
            self.num_workers,
            optimizers[0],
            (),
            digest,
            self.quorum,
            groups=tuple(optimizers[1:]),
            min_workers=self.min_workers,
            max_workers=self.max_workers,
        )
        jobs = shard_jobs(shard_map, layouts, self._buffers, group, job, proposed)

        def init_one(shard: int, check_only: bool = False) -> None:
            link = self.links[shard]
            job = job_to_proto(jobs[shard])
            values = send_values and not check_only
            header = ps_pb2.InitHeader(
                worker_id=self.worker_id, job=job, has_values=values, check_only=check_only
            )

            def stream() -> Iterator[bytes | ps_pb2.InitRequest]:
                yield ps_pb2.InitRequest(header=header)
                if values:
                    for key, array in pieces[shard].items():
                        yield from encode_chunk_messages(key, array, 2, self.chunk_bytes)

            reply = link.call("Init", lambda stub: stub.Init(stream(), timeout=self.timeout))
            if not check_only:
                link.identity.check(reply.job_id, f"shard {shard} ({link.address})")

        with self._stall.waiting("init (the initial values)", None if send_values else -1):
            if send_values and any(t.init_from for t in tables.values()):
                # Every shard reads its rows of the file first: one that cannot leaves none
                # holding the job (a retry would otherwise mix old rows with new).
                self._fan_out(lambda shard: init_one(shard, check_only=True))
            self._fan_out(init_one)
        self.shards.place(shard_map, layouts)
        self.step = min(int(r.clock) for r in registered)
        self._beats.start(min((r.heartbeat_timeout_s for r in registered), default=0.0))
        say_resumed(self.worker_id, self.identity.value, self.step)

    def pull(
        self, names: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Fresh weights, once the job's consistency rule lets this worker read.

        In ``sync`` this waits until every worker's push for the previous step is applied; in
        ``ssp`` until no worker is more than ``staleness`` steps behind; in ``async`` never.

        ``out``: arrays (the variables' shape and dtype, writable) to receive some variables
        in place of new ones, e.g. the model's own memory: the bytes are decoded straight into
        them, with no second copy. If the pull fails, their contents are unspecified.

        Raises:
            UnknownVariableError: a name not in the model.
            InvalidRequestError: an ``out`` array of the wrong shape or dtype, or read-only.
            WaitTimeoutError: the rule did not allow reading within the deadline.
        """
        shard_map = self._require_map()
        wanted, keys_by_shard = self._keys(names)
        shard_map.check_out(out, wanted)
        into = shard_map.destinations(wanted, out)

        def pull_one(shard: int) -> dict[str, np.ndarray]:
            if not keys_by_shard[shard]:
                return {}
            request = ps_pb2.PullRequest(
                worker_id=self.worker_id, step=self.step, names=keys_by_shard[shard]
            )
            return self.links[shard].pull(request, into)

        with self._stall.reading(f"pull at step {self.step}", self.step):
            parts = self._fan_out(pull_one)
        merged = shard_map.merge(parts)
        return shard_map.join(merged, wanted, into, out)

    def push(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        options: StepOptions | None = None,
    ) -> bool:
        """Sends this worker's gradients for one step to the shards that own them, with
        ``options`` (hyper-parameters that differ from the job's; a GradScaler's skip).

        A table's gradient is a ``RowSparse`` (row ids and their gradient rows; repeated ids
        are summed); each shard gets the rows it holds. Every shard hears from every push, even
        with nothing for it, so ``sync`` steps and ``ssp`` clocks advance everywhere. ``step``
        defaults to the client's counter, which then advances by one. A retried push of the
        same step is acknowledged by the shards without being applied twice. Returns whether
        every shard applied it (False: some shard had it already).

        Raises:
            UnknownVariableError: a name not in the model.
            InvalidRequestError: wrong shape or dtype, NaN/Inf values, bad row ids.
        """
        step = self.step if step is None else step
        pieces = self._pieces(grads)
        replies = self._push_all(step, lambda s: self.links[s].push(step, pieces[s], options))
        self.last_skipped = bool(options and options.skip)
        return self._pushed(step, replies)

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
        rows: Mapping[str, np.ndarray | Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """``push(grads, step, options)`` then ``pull(out=out)``, and ``rows`` (table -> ids:
        the next batch's rows, returned under the table's name, as ``pull_rows``): one
        message each way per shard on a call kept open across steps when the shard's part of
        each fits in ``chunk_bytes``, else a streamed push, then a streamed pull. The weights
        and rows are what ``pull()`` and ``pull_rows`` would return at the next step.

        Raises:
            as ``push``, ``pull`` and ``pull_rows``.
        """
        shard_map = self._require_map()
        step = self.step if step is None else step
        pieces = self._pieces(grads)
        reads = self._rows.reads(rows)
        wanted, keys_by_shard = self._keys(None)
        shard_map.check_out(out, wanted)
        into = shard_map.destinations(wanted, out)
        pull_bytes = shard_map.shard_bytes()

        plans = []  # each shard's (row reads, where its reply goes, whether one message fits)
        for shard in range(len(self.links)):
            queries = [q for r in reads.values() if (q := r.query(shard)) is not None]
            row_bytes = sum(r.nbytes(shard) for r in reads.values())
            # A table's ids ride along uncounted: 4096 rows of dim 256 are still one message.
            push_bytes = sum(
                p.values.nbytes if isinstance(p, RowSparse) else p.nbytes
                for p in pieces[shard].values()
            )
            fits = max(push_bytes, pull_bytes[shard] + row_bytes) <= self.chunk_bytes
            plans.append((queries, into_with_rows(into, reads, shard), fits))

        def start(shard: int) -> Callable[[], tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]]:
            link, (queries, targets, fits) = self.links[shard], plans[shard]
            if fits:
                finish = link.start_push_pull(step, pieces[shard], targets, options, queries)
            else:  # Too big for one message each way: stream the push, then the pull.
                names = keys_by_shard[shard] if queries else []
                pull = ps_pb2.PullRequest(
                    worker_id=self.worker_id, step=self.step, names=names, rows=queries
                )
                finish = partial(link.push_then_pull, step, pieces[shard], options, pull, targets)

            def done() -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
                pushed, arrays = finish()
                place_rows(reads, shard, arrays, link.where("PushPull"))
                return pushed, arrays

            return done

        with self._stall.reading(f"step {step}", step + 1):
            if all(fits for *_, fits in plans):  # every shard sent its part before any waits
                # A shard's call that ends early (it restarted) is recovered while others wait.
                results = self._settled(step, *self.shards.settle_started(start))
            else:
                results = self._push_all(step, lambda shard: start(shard)())
        self._pushed(step, [r for r, _ in results])
        self.last_skipped = any(r.skipped for r, _ in results) or bool(options and options.skip)
        merged = shard_map.merge([arrays for _, arrays in results])
        weights = shard_map.join(merged, wanted, into, out)
        return {**weights, **{t: r.result() for t, r in reads.items()}}

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Rows ``ids`` of an embedding table, shape ``(len(ids), dim)``, in the order asked.

        Ids are deduplicated before they travel; each shard is asked only for its own rows, in
        parallel, once the consistency rule lets this worker read (as ``pull``). A dynamic
        table makes a row the first time any worker touches it.

        Raises:
            UnknownVariableError: no such table.
            InvalidRequestError: ids that are not integers, or outside a fixed table's rows.
        """
        return self._rows.pull_rows(table, ids, self.step)

    def optimizer_state(self) -> Slots:
        """Every trained variable's optimizer slots (arrays; counts such as Adam's step as
        ints), a split variable's pieces joined; slots not made yet are left out.

        Raises:
            PSError: a shard failed to answer.
        """
        return self._state.optimizer_state()

    def load_state(
        self,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        digest: str,
    ) -> None:
        """Worker 0: its ``values`` and optimizer ``slots`` replace the shards' (a trained
        variable left out of ``slots`` starts its optimizer state afresh). Other workers send
        nothing but ``digest``: they wait until worker 0 has loaded, and check it loaded the
        same state.

        Raises:
            ModelMismatchError: this worker loaded another state than worker 0.
            UnknownVariableError, InvalidRequestError: a bad state (the shards changed nothing).
            WaitTimeoutError: worker 0 did not load in time.
        """
        self._state.load_state(values, slots, digest)

    def _keys(self, names: Sequence[str] | None) -> tuple[list[str], list[list[str]]]:
        """(the variables asked for, each shard's piece keys of them).

        Raises:
            UnknownVariableError, InvalidRequestError: a name not in the model, or a table.
        """
        shard_map = self._require_map()
        if names is None:  # every variable: the map knows each shard's keys
            return [v.name for v in shard_map.variables], [list(k) for k in shard_map.keys_by_shard]
        wanted = list(names)
        keys_by_shard: list[list[str]] = [[] for _ in self.links]
        for name in wanted:
            parts = shard_map.pieces_of(name)
            if not parts and name in self.tables:
                raise InvalidRequestError(
                    f"'{name}' is an embedding table: read its rows with pull_rows(name, ids)"
                )
            if not parts:
                raise not_in_model(name, (v.name for v in shard_map.variables))
            for p in parts:
                keys_by_shard[p.shard].append(p.key)
        return wanted, keys_by_shard

    def _pieces(
        self, grads: Mapping[str, np.ndarray | RowSparse]
    ) -> list[dict[str, np.ndarray | RowSparse]]:
        """Each shard's part of a push, everything a worker can know checked first.

        Raises:
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: bad gradients.
        """
        shard_map = self._require_map()
        return split_push(grads, shard_map, self.tables, self._buffers, self.compression)

    def _pushed(self, step: int, replies: Sequence[ps_pb2.PushResponse]) -> bool:
        """Advances the step counter past a push every shard answered; whether all applied
        (False: a retry the shards already had, or, with backup workers, a late push).

        Raises:
            WorkerDroppedError: without backup workers, a sync push came too late: this
                worker had been dropped from the quorum, and its gradient was not applied.
        """
        self.step = max(self.step, step + 1)
        self._absent.update(replies)
        late = [(i, int(r.next_step)) for i, r in enumerate(replies) if r.reason == "late"]
        if late:
            # A backup-worker step closed without us: move on to the step the shards are in.
            self.step = max(self.step, min(after for _, after in late))
            if not self.quorum:
                raise WorkerDroppedError(
                    f"worker {self.worker_id}'s push for step {step} arrived after that step "
                    f"closed without it on shards {[i for i, _ in late]}: the shards had dropped "
                    "this worker from the quorum (silent past their --heartbeat-timeout), so "
                    "its gradient was not applied. Training on would leave this worker's data "
                    "out of the model unnoticed; restart the job (from a checkpoint)"
                )
            log.warning(
                "worker %d: push for step %d came after its step closed (backup workers, "
                "quorum %d): not applied, moving on to step %d",
                self.worker_id,
                step,
                self.quorum,
                self.step,
            )
        return all(r.applied for r in replies)

    @property
    def absent(self) -> frozenset[int]:
        """The workers the shards last said are out of the quorum (sync, ssp)."""
        return self._absent.current

    def heartbeat(self, seconds_per_step: float = 0.0) -> float:
        """Tells every shard this worker is alive (a background thread does this every
        ``heartbeat_s`` seconds after ``init``), with its pace where measured (seconds per
        inner step, DiLoCo's dynamic local steps; 0: none); returns the fastest pace of a
        live worker the shards know (0: none).

        Raises:
            PSError: a shard refused (InvalidRequestError: a pace that is not finite,
                negative or over a day) or could not be reached.
        """
        request = ps_pb2.HeartbeatRequest(
            worker_id=self.worker_id, session=self.session, seconds_per_step=seconds_per_step
        )
        replies = self._fan_out(
            lambda s: self.links[s].call(
                "Heartbeat", lambda stub: stub.Heartbeat(request, timeout=self.timeout)
            )
        )
        paces = [r.fastest_seconds_per_step for r in replies if r.fastest_seconds_per_step > 0]
        return min(paces, default=0.0)

    def status(self) -> list[ps_pb2.StatusResponse]:
        """Each shard's status, in address order."""
        return shard_status(self.addresses, self.timeout, self.security)

    # -- internals --------------------------------------------------------------------------

    def _require_map(self) -> ShardMap:
        return self.shards.require_map()

    def _push_all(self, step: int, fn: Callable[[int], T]) -> list[T]:
        """``fn`` on every shard, all run to the end; see ``_settled``."""
        return self._settled(step, *self.shards.settle(fn))

    def _settled(self, step: int, done: list[T], failed: list[tuple[int, Exception]]) -> list[T]:
        """Every shard's result, or the failure to raise; see ``fanout.partial_failure``.

        Raises:
            PSError: the first shard's error.
        """
        if not failed:
            return done
        partial = partial_failure(step, failed, len(self.links))
        if partial is None:
            raise failed[0][1]
        self.step = max(self.step, step + 1)
        raise partial from failed[0][1]

    def _fan_out(self, fn: Callable[[int], T]) -> list[T]:
        return self.shards.each(fn)

    def start_shard_step(
        self,
        shard: int,
        grads: Mapping[str, np.ndarray],
        step: int,
        out: Mapping[str, np.ndarray],
        options: StepOptions | None = None,
    ) -> Callable[[], bool]:
        """One shard's part of ``push_pull(grads, step, out=out, options=options)``, for a
        caller that starts each shard's step when its gradients are ready (overlap with
        backward): sends ``shard`` its pieces of ``grads`` (dense; other shards' pieces are
        ignored) now, and returns the call that waits for the reply, decodes the shard's
        weights into ``out`` (arrays for every variable, e.g. the model's memory) and says
        whether the step was skipped (a worker's GradScaler). Started and waited for once per
        shard, this is one ``push_pull``: the step counter then is past ``step``. One shard's
        steps are waited for in order.

        Raises:
            as ``push``; the returned call: as ``push_pull``.
        """
        shard_map = self._require_map()
        piece = self._pieces(grads)[shard]
        wanted = [v.name for v in shard_map.variables]
        shard_map.check_out(out, wanted)
        into = shard_map.destinations(wanted, out)
        link = self.links[shard]
        sent = sum(p.nbytes for p in piece.values())
        if max(sent, shard_map.shard_bytes()[shard]) <= self.chunk_bytes:
            finish = link.start_push_pull(step, piece, into, options)
        else:  # Too big for one message each way: stream the push, then the pull.
            pull = ps_pb2.PullRequest(worker_id=self.worker_id, step=step)
            finish = partial(link.push_then_pull, step, piece, options, pull, into)

        def done() -> bool:
            reply, pieces = finish()
            copy_in(pieces, into)
            self._pushed(step, [reply])
            return bool(reply.skipped)

        return done

    def stream_step(
        self,
        step: int,
        order: Sequence[str],
        buffers: Sequence[str],
        out: Mapping[str, np.ndarray],
        options: StepOptions | None = None,
        placed: Callable[[str], None] | None = None,
    ) -> StepStreams:
        """A step whose push streams to the shards while backward produces it (overlap):
        each shard whose step goes on its data port gets the manifest now (the gradients of
        ``order``, in that order, then the ``buffers``), then each tensor as it is
        ``add``-ed; the reply is decoded into ``out`` (arrays for every variable), and
        ``placed`` told each piece key as it lands there (from the streams' threads). See
        psworker/push_stream.py. Run each of its ``shards`` with ``run(shard)`` on a thread
        of its own; the step counter is past ``step`` once each has returned.

        Raises:
            UnknownVariableError: a name not in the model.
            InvalidRequestError: an ``out`` array of the wrong shape or dtype.
        """
        shard_map = self._require_map()
        wanted = [v.name for v in shard_map.variables]
        shard_map.check_out(out, wanted)
        for name in [*order, *buffers]:
            if name not in shard_map.infos:
                raise not_in_model(name, shard_map.infos)
        into = shard_map.destinations(wanted, out)
        return StepStreams(
            self.links,
            shard_map,
            step,
            order,
            buffers,
            into,
            options,
            self.compression,
            self._pushed,
            placed,
        )
