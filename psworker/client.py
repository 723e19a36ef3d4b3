"""The numpy-level client: init, pull and push against every shard in parallel."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Self, TypeVar

import grpc
import numpy as np

from pswire.codec import COMPRESSIONS, DEFAULT_CHUNK_BYTES
from pswire.errors import (
    ClientClosedError,
    ConfigError,
    InvalidRequestError,
    NotInitializedError,
    WorkerDroppedError,
    not_in_model,
)
from pswire.job import MODES, Job, job_to_proto
from pswire.optim import Optimizer
from pswire.optspec import StepOptions, resolve_groups
from pswire.piecekey import check_names
from pswire.proto import ps_pb2
from pswire.security import ClientSecurity
from pswire.tables import RowSparse, Table
from pswire.wiremsg import encode_chunk_messages
from psworker.client_state import ClientState
from psworker.fanout import FanOut, partial_failure
from psworker.link import ShardLink, shard_status
from psworker.outgoing import check_shards_agree, shard_jobs, split_push
from psworker.placement import (
    DEFAULT_SPLIT_BYTES,
    ShardMap,
    TableLayout,
    VarInfo,
    plan,
    tables_digest,
)
from psworker.session import (
    DEFAULT_REPLAY_BYTES,
    AbsentWorkers,
    Heartbeats,
    JobIdentity,
    LinkConfig,
    leave_at_exit,
    say_resumed,
)
from psworker.stall import DEFAULT_STALL_WARNING_S, StallWatch, shard_statuses
from psworker.tables_client import TableReads, into_with_rows, place_rows

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_S = 2.0  # well inside the shards' default 30 s heartbeat timeout
log = logging.getLogger(__name__)


class PSClient(ClientState, TableReads):
    """A worker's connection to the parameter-server shards of one job.

    Every call fans out to all shards in parallel and has a deadline (``timeout`` seconds);
    a failure raises a ``PSError`` subclass whose ``.code`` is the gRPC status. ``security``
    (TLS files, token) applies to every shard; None means plaintext without a token.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        worker_id: int,
        num_workers: int,
        mode: str = "sync",
        staleness: int = 0,
        timeout: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        security: ClientSecurity | None = None,
        quorum: int = 0,
        retry_s: float | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = (),
        compression: str | None = None,
        job_id: str = "",
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
        stall_warning_s: float = DEFAULT_STALL_WARNING_S,
    ) -> None:
        if not addresses:
            raise ConfigError("connect needs at least one shard address")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= worker_id < num_workers:
            raise ConfigError(f"worker_id {worker_id} must be in [0, {num_workers})")
        if compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if mode == "ssp" and staleness < 0:
            raise ConfigError(f"staleness must be >= 0, got {staleness}")
        self.addresses = list(addresses)
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.mode = mode
        self.staleness = staleness if mode == "ssp" else 0
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.split_bytes = split_bytes
        self.step = 0
        self.last_skipped = False  # the step last pushed had no optimizer update
        self.shard_map: ShardMap | None = None
        self.quorum = quorum
        self.min_workers = self.max_workers = 0  # an elastic job's bounds (ElasticPSClient)
        self.compression = compression
        # What else the job's workers must agree on beyond the model (e.g. DiLoCo's local steps
        # and inner optimizer, psworker/diloco.py): part of the model digest init declares.
        self.variant = ""
        self._buffers: set[str] = set()
        self.tables: dict[str, TableLayout] = {}
        self.heartbeat_s = heartbeat_s
        self.security = security or ClientSecurity()
        self._channels = [self.security.channel(a) for a in self.addresses]
        channels = [grpc.intercept_channel(c, *interceptors) for c in self._channels]
        # This process's id: a second process claiming the same worker id is refused.
        self.session = uuid.uuid4().hex[:12]
        self.identity = JobIdentity(job_id)
        retry = timeout if retry_s is None else retry_s
        config = LinkConfig(
            worker_id, num_workers, timeout, retry, chunk_bytes, self.session, replay_bytes
        )
        self.links = [
            ShardLink(i, a, channel, config, self.identity, self.security)
            for i, (a, channel) in enumerate(zip(self.addresses, channels, strict=True))
        ]
        self._absent = AbsentWorkers(worker_id)
        self._fan = FanOut(len(self.addresses))
        self._beats = Heartbeats(self.links, heartbeat_s, worker_id, self.session)
        probe = partial(shard_statuses, self.links)
        self._stall = StallWatch(stall_warning_s, worker_id, probe, self.mode, self.staleness)
        self._closed = False
        leave_at_exit(self)

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leaves the job (the shards stop counting this worker in the sync quorum and the ssp
        gate), stops heartbeats and closes the channels; the client is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._beats.stop()
        self._stall.close()
        if self.shard_map is not None:  # only a worker that joined (init) leaves
            self._fan.settle(lambda shard: self.links[shard].leave())
        self._fan.close()
        for link in self.links:
            link.close()
        for channel in self._channels:
            channel.close()

    # -- API --------------------------------------------------------------------------------

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer | Sequence[Optimizer],
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
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
        train them with ``RowSparse`` gradients in ``push``.

        Raises:
            ModelMismatchError: a shard holds a different model, mode or optimizer.
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
            shard_map = plan(infos, len(self.addresses), self.split_bytes)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        layouts = {n: TableLayout.build(n, t, len(self.addresses)) for n, t in tables.items()}
        digest = shard_map.digest()
        if tables:  # a model without tables keeps the digest it always had
            digest = hashlib.sha256((digest + tables_digest(tables)).encode()).hexdigest()[:16]
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

        def init_one(shard: int) -> None:
            link = self.links[shard]
            job = job_to_proto(jobs[shard])
            header = ps_pb2.InitHeader(worker_id=self.worker_id, job=job, has_values=send_values)

            def stream() -> Iterator[bytes | ps_pb2.InitRequest]:
                yield ps_pb2.InitRequest(header=header)
                if send_values:
                    for key, array in pieces[shard].items():
                        yield from encode_chunk_messages(key, array, 2, self.chunk_bytes)

            reply = link.call("Init", lambda stub: stub.Init(stream(), timeout=self.timeout))
            link.identity.check(reply.job_id, f"shard {shard} ({link.address})")

        with self._stall.waiting("init (the initial values)", None if send_values else -1):
            self._fan_out(init_one)
        self.shard_map = shard_map
        self.tables = layouts
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
        reads = self._reads(rows)
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
                ended = lambda shard, fn: self.links[shard].steps.when_ended(fn)  # noqa: E731
                results = self._settled(step, *self._fan.settle_started(start, ended))
            else:
                results = self._push_all(step, lambda shard: start(shard)())
        self._pushed(step, [r for r, _ in results])
        self.last_skipped = any(r.skipped for r, _ in results) or bool(options and options.skip)
        merged = shard_map.merge([arrays for _, arrays in results])
        weights = shard_map.join(merged, wanted, into, out)
        return {**weights, **{t: r.result() for t, r in reads.items()}}

    def _keys(self, names: Sequence[str] | None) -> tuple[list[str], list[list[str]]]:
        """(the variables asked for, each shard's piece keys of them).

        Raises:
            UnknownVariableError, InvalidRequestError: a name not in the model, or a table.
        """
        shard_map = self._require_map()
        if names is None:  # every variable: the map knows each shard's keys
            return [v.name for v in shard_map.variables], [list(k) for k in shard_map.keys_by_shard]
        wanted = list(names)
        keys_by_shard: list[list[str]] = [[] for _ in self.addresses]
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

    def heartbeat(self) -> None:
        """Tells every shard this worker is alive (a background thread does this every
        ``heartbeat_s`` seconds after ``init``)."""
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, session=self.session)
        self._fan_out(
            lambda s: self.links[s].call(
                "Heartbeat", lambda stub: stub.Heartbeat(request, timeout=self.timeout)
            )
        )

    def status(self) -> list[ps_pb2.StatusResponse]:
        """Each shard's status, in address order."""
        return shard_status(self.addresses, self.timeout, self.security)

    # -- internals --------------------------------------------------------------------------

    def _require_map(self) -> ShardMap:
        self._require_open()
        if self.shard_map is None:
            raise NotInitializedError("call client.init(variables, optimizer) before pull or push")
        return self.shard_map

    def _push_all(self, step: int, fn: Callable[[int], T]) -> list[T]:
        """``fn`` on every shard, all run to the end; see ``_settled``."""
        return self._settled(step, *self._fan.settle(fn))

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

    def _require_open(self) -> None:
        if self._closed:
            raise ClientClosedError(f"worker {self.worker_id}'s client is closed: connect again")

    def _fan_out(self, fn: Callable[[int], T]) -> list[T]:
        self._require_open()
        return self._fan.each(fn)
