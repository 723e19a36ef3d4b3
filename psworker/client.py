"""The numpy-level client: init, pull and push against every shard in parallel."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from pswire.codec import COMPRESSIONS, DEFAULT_CHUNK_BYTES, float32_to_bfloat16
from pswire.errors import InvalidRequestError, NotInitializedError, PSError, not_in_model
from pswire.job import MODES, Job, VarSpec, job_to_proto
from pswire.optim import Optimizer, StepOptions, resolve_groups
from pswire.proto import ps_pb2
from pswire.security import ClientSecurity
from pswire.tables import RowSparse, Table, as_ids
from pswire.wiremsg import encode_chunk_messages
from psworker.client_state import ClientState
from psworker.link import ShardLink
from psworker.placement import (
    DEFAULT_SPLIT_BYTES,
    ShardMap,
    TableLayout,
    VarInfo,
    plan,
    tables_digest,
)
from psworker.shard_status import status

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 120.0
# Well inside the shards' default 30 s heartbeat timeout, cheap enough to never matter.
DEFAULT_HEARTBEAT_S = 2.0
log = logging.getLogger(__name__)


class PSClient(ClientState):
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
    ) -> None:
        if not addresses:
            raise ValueError("connect needs at least one shard address")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id {worker_id} must be in [0, {num_workers})")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if mode == "ssp" and staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
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
        self.compression = compression
        self._buffers: set[str] = set()
        self.tables: dict[str, TableLayout] = {}
        self.heartbeat_s = heartbeat_s
        self.security = security or ClientSecurity()
        self._channels = [self.security.channel(a) for a in self.addresses]
        channels = [grpc.intercept_channel(c, *interceptors) for c in self._channels]
        self.links = [
            ShardLink(
                i,
                a,
                channel,
                worker_id,
                num_workers,
                timeout,
                timeout if retry_s is None else retry_s,
                chunk_bytes,
            )
            for i, (a, channel) in enumerate(zip(self.addresses, channels, strict=True))
        ]
        self._pool = ThreadPoolExecutor(max_workers=len(self.addresses), thread_name_prefix="ps")
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops heartbeats and closes the channels; the client is unusable afterwards."""
        self._stop.set()
        if self._beater is not None:
            self._beater.join(timeout=2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for link in self.links:
            link.steps.close()
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

        ``optimizer``: one, or one per parameter group (the same class); ``groups`` gives a
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
            shard_map = plan(infos, len(self.addresses), self.split_bytes)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        layouts = {n: TableLayout.build(n, t, len(self.addresses)) for n, t in tables.items()}
        digest = shard_map.digest()
        if tables:  # a model without tables keeps the digest it always had
            digest = hashlib.sha256((digest + tables_digest(tables)).encode()).hexdigest()[:16]
        send_values = self.worker_id == 0
        pieces = shard_map.split(arrays)
        averaged = set(buffers)
        self._buffers = averaged
        optimizers, group = resolve_groups(optimizer, groups, [*arrays, *tables])

        def register(shard: int) -> int:
            link = self.links[shard]
            reply = link.call("RegisterWorker", lambda _: link.register())
            link.incarnation = reply.incarnation
            return int(reply.clock)

        def init_one(shard: int) -> None:
            variables = [
                VarSpec(p.key, p.shape, p.dtype, p.var in averaged, group=group[p.var])
                for p in shard_map.on_shard(shard)
            ] + [VarSpec.of_table(t.slice_for(shard), group[n]) for n, t in layouts.items()]
            job = job_to_proto(
                Job(
                    mode=self.mode,
                    staleness=self.staleness,
                    num_workers=self.num_workers,
                    optimizer=optimizers[0],
                    variables=tuple(variables),
                    model_digest=digest,
                    quorum=self.quorum,
                    groups=optimizers[1:],
                )
            )
            header = ps_pb2.InitHeader(worker_id=self.worker_id, job=job, has_values=send_values)

            def stream() -> Iterator[bytes | ps_pb2.InitRequest]:
                yield ps_pb2.InitRequest(header=header)
                if send_values:
                    for key, array in pieces[shard].items():
                        yield from encode_chunk_messages(key, array, 2, self.chunk_bytes)

            self._call(shard, "Init", lambda stub: stub.Init(stream(), timeout=self.timeout))

        clocks = self._fan_out(register)
        self._fan_out(init_one)
        self.shard_map = shard_map
        self.tables = layouts
        self.step = min(clocks)
        if self.heartbeat_s > 0 and self._beater is None:
            self._beater = threading.Thread(
                target=self._heartbeats, name=f"ps-heartbeat-{self.worker_id}", daemon=True
            )
            self._beater.start()

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

        merged: dict[str, np.ndarray] = {}
        for part in self._fan_out(pull_one):
            merged.update(part)
        return shard_map.join(merged, wanted, into, out)

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Rows ``ids`` of an embedding table, shape ``(len(ids), dim)``, in the order asked.

        Ids are deduplicated before they travel; each shard is asked only for its own rows, in
        parallel, once the consistency rule lets this worker read (as ``pull``). A dynamic
        table makes a row the first time any worker touches it.

        Raises:
            UnknownVariableError: no such table.
            InvalidRequestError: ids that are not integers, or outside a fixed table's rows.
        """
        layout = self._layout(table)
        ids = as_ids(table, ids)
        layout.check_ids(ids, "pull")
        unique, inverse = np.unique(ids, return_inverse=True)
        owner = layout.shard_of(unique)

        def pull_one(shard: int) -> np.ndarray | None:
            mine = unique[owner == shard]
            if not len(mine):
                return None
            query = ps_pb2.RowQuery(table=table, ids=mine.astype("<i8").tobytes())
            request = ps_pb2.PullRequest(worker_id=self.worker_id, step=self.step, rows=[query])
            return self.links[shard].pull(request)[table]

        out = np.empty((len(unique), layout.table.dim), dtype=layout.table.dtype)
        for shard, rows in enumerate(self._fan_out(pull_one)):
            if rows is not None:
                out[owner == shard] = rows
        return out[inverse.reshape(-1)]

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

        replies = self._fan_out(lambda s: self.links[s].push(step, pieces[s], options))
        self.last_skipped = bool(options and options.skip)
        return self._pushed(step, replies)

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
    ) -> dict[str, np.ndarray]:
        """``push(grads, step, options)`` then ``pull()``: one round trip per shard when the part
        of the push and of the weights each fit in ``chunk_bytes`` (small models are bound by
        per-call latency: one message each way on a call kept open across steps), else a
        streamed push, then a streamed pull.

        Each shard applies the push as ``push`` does, then answers with its variables once the
        consistency rule lets this worker read the next step: what ``pull()`` would return.
        ``out`` as for ``pull``.

        Raises:
            as ``push`` and ``pull``.
        """
        shard_map = self._require_map()
        step = self.step if step is None else step
        pieces = self._pieces(grads)
        wanted, _ = self._keys(None)
        shard_map.check_out(out, wanted)
        into = shard_map.destinations(wanted, out)
        pull_bytes = shard_map.shard_bytes()

        def one(shard: int) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
            link = self.links[shard]
            push_bytes = sum(p.nbytes for p in pieces[shard].values())
            if max(push_bytes, pull_bytes[shard]) <= self.chunk_bytes:
                return link.push_pull(step, pieces[shard], into, options)
            # Too big for one message each way: stream the push, then the pull.
            pushed = link.push(step, pieces[shard], options)
            after = max(self.step, int(pushed.next_step))
            request = ps_pb2.PullRequest(worker_id=self.worker_id, step=after)
            arrays = link.pull(request, into)
            pushed.skipped = pushed.skipped or link.pull_skipped
            return pushed, arrays

        results = self._fan_out(one)
        self._pushed(step, [r for r, _ in results])
        self.last_skipped = any(r.skipped for r, _ in results) or bool(options and options.skip)
        merged: dict[str, np.ndarray] = {}
        for _, arrays in results:
            merged.update(arrays)
        return shard_map.join(merged, wanted, into, out)

    def _keys(self, names: Sequence[str] | None) -> tuple[list[str], list[list[str]]]:
        """(the variables asked for, each shard's piece keys of them).

        Raises:
            UnknownVariableError, InvalidRequestError: a name not in the model, or a table.
        """
        shard_map = self._require_map()
        wanted = list(names) if names is not None else [v.name for v in shard_map.variables]
        keys_by_shard: list[list[str]] = [[] for _ in self.addresses]
        for name in wanted:
            parts = shard_map.pieces_of(name)
            if not parts and name in self.tables:
                raise InvalidRequestError(
                    f"'{name}' is an embedding table: read its rows with pull_rows(name, ids)"
                )
            if not parts:
                raise self._unknown(name)
            for p in parts:
                keys_by_shard[p.shard].append(p.key)
        return wanted, keys_by_shard

    def _pieces(
        self, grads: Mapping[str, np.ndarray | RowSparse]
    ) -> list[dict[str, np.ndarray | RowSparse]]:
        """Each shard's part of a push (compressed as asked; a table's rows by owner).

        Raises:
            UnknownVariableError, InvalidRequestError: a name not in the model, bad rows.
        """
        shard_map = self._require_map()
        dense = {n: g for n, g in grads.items() if not isinstance(g, RowSparse)}
        arrays = {name: self._compress(name, np.asarray(g)) for name, g in dense.items()}
        pieces: list[dict[str, np.ndarray | RowSparse]] = [dict(p) for p in shard_map.split(arrays)]
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                for shard, part in enumerate(self._split_rows(name, grad)):
                    if part is not None:
                        pieces[shard][name] = part
        return pieces

    def _pushed(self, step: int, replies: Sequence[ps_pb2.PushResponse]) -> bool:
        """Advances the step counter past a push every shard answered; whether all applied."""
        self.step = max(self.step, step + 1)
        late = [int(r.next_step) for r in replies if r.reason == "late"]
        if late:
            # A backup-worker step closed without us: move on to the step the shards are in.
            self.step = max(self.step, min(late))
        return all(r.applied for r in replies)

    def heartbeat(self) -> None:
        """Tells every shard this worker is alive (a background thread does this every
        ``heartbeat_s`` seconds after ``init``)."""
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id)
        self._fan_out(
            lambda s: self._call(
                s, "Heartbeat", lambda stub: stub.Heartbeat(request, timeout=self.timeout)
            )
        )

    def _heartbeats(self) -> None:
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id)
        while not self._stop.wait(self.heartbeat_s):
            for link in self.links:
                try:
                    link.stub.Heartbeat(request, timeout=max(1.0, self.heartbeat_s))
                except grpc.RpcError as exc:  # the training calls report and recover
                    log.debug("heartbeat to shard %d failed: %s", link.index, exc.code())

    def status(self) -> list[ps_pb2.StatusResponse]:
        """Each shard's status, in address order."""
        return status(self.addresses, self.timeout, self.security)

    # -- internals --------------------------------------------------------------------------

    def _compress(self, name: str, grad: np.ndarray) -> np.ndarray:
        """float32 gradients in 16 bits on the wire when asked (the shards widen them back)."""
        if self.compression is None or grad.dtype != np.float32 or name in self._buffers:
            return grad
        if self.compression == "fp16":
            with np.errstate(over="ignore"):  # overflow -> inf, which the shard refuses by name
                return grad.astype(np.float16)
        return float32_to_bfloat16(grad)

    def _split_rows(self, table: str, grad: RowSparse) -> list[RowSparse | None]:
        """A table's gradient cut into each shard's rows (None: no rows there).

        Raises:
            UnknownVariableError, InvalidRequestError: no such table, or bad ids or rows.
        """
        layout = self._layout(table)
        ids = as_ids(table, grad.ids)
        values = np.asarray(grad.values)
        if values.shape != (len(ids), layout.table.dim):
            raise InvalidRequestError(
                f"table '{table}': push sent {len(ids)} ids with rows of shape {values.shape}; "
                f"expected ({len(ids)}, {layout.table.dim})"
            )
        layout.check_ids(ids, "push")
        values = self._compress(table, values)
        owner = layout.shard_of(ids)
        parts: list[RowSparse | None] = []
        for shard in range(len(self.addresses)):
            mask = owner == shard
            parts.append(RowSparse(ids[mask], values[mask]) if mask.any() else None)
        return parts

    def _layout(self, table: str) -> TableLayout:
        self._require_map()
        layout = self.tables.get(table)
        if layout is None:
            raise not_in_model(table, self.tables, "table")
        return layout

    def _require_map(self) -> ShardMap:
        if self.shard_map is None:
            raise NotInitializedError("call client.init(variables, optimizer) before pull or push")
        return self.shard_map

    def _unknown(self, name: str) -> PSError:
        return not_in_model(name, (v.name for v in self._require_map().variables))

    def _call(self, shard: int, rpc: str, fn: Callable[[Any], T]) -> T:
        return self.links[shard].call(rpc, fn)

    def _fan_out(self, fn: Callable[[int], T]) -> list[T]:
        if len(self.addresses) == 1:
            return [fn(0)]
        futures = [self._pool.submit(fn, s) for s in range(len(self.addresses))]
        return [f.result() for f in futures]
