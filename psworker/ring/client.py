"""``mode="allreduce"``: no servers; workers average gradients over a gRPC ring, step locally."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pscore.optim import Optimizer
from pscore.optspec import StepOptions, group_optimizers, resolve_groups
from pscore.tables import RowSparse, Table
from pswire.codec import COMPRESSIONS
from pswire.errors import (
    ConfigError,
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    PSError,
    not_in_model,
)
from pswire.security import ClientSecurity
from psworker.api import push_then_pull
from psworker.local import LocalClient
from psworker.ring import agreement
from psworker.ring.algorithm import DEFAULT_TIMEOUT_S
from psworker.ring.buckets import DEFAULT_BUCKET_BYTES, BucketPlan
from psworker.ring.reduction import StepReduction
from psworker.ring.ring import Ring, RingServer

# The skip flag travels in the gradients' all-reduce as one more tensor: a step any worker's
# GradScaler skipped is skipped by all, with no extra round.
SKIP_KEY = "\x00skip"
# One flag per variable: which names any worker pushed this step (the others are left as they
# are, as the shards leave a variable no worker pushed: another model's, a None gradient's).
PUSHED_KEY = "\x00pushed"
# The gradients' bucket plan is one of the settings ranks agree on: it follows init's order of
# the variables, which ranks could list differently.
_PLAN_SETTING = "gradient buckets (init's order of the variables)"
_NO_TABLES = (
    "embedding tables {} live on parameter-server shards; mode 'allreduce' has none "
    "(use sync, async, ssp or local)"
)


class AllReduceClient:
    """The ``Client`` role without shards; every worker holds a full replica (like Horovod or DDP).

    ``init`` broadcasts worker 0's values so replicas start bit-identical. ``push`` sums the
    gradients over the ring in buckets of ``bucket_bytes`` (the same plan on every worker),
    divides by the worker count, and applies the optimizer locally with the shards' math, so
    every replica takes the same step. ``compression`` ("fp16" or "bf16") sends gradients in
    16 bits; the ring accumulates them in float32. Buffers are averaged the same way. Each
    step the ranks also compare what they apply (``agreement``): ranks with other optimizer
    settings or step hyper-parameters raise ``HyperParameterMismatchError`` before applying.
    """

    mode = "allreduce"
    staleness = 0

    def __init__(
        self,
        rank: int,
        peers: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        compression: str | None = None,
        server: RingServer | None = None,
        security: ClientSecurity | None = None,
        rendezvous: object = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.worker_id = rank
        self.num_workers = len(peers)
        self.addresses = list(peers)
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        self.ring = Ring(rank, peers, timeout=timeout, server=server, security=security)
        # The rendezvous store (psworker.ring.rendezvous) this rank may host: kept until close.
        self._rendezvous = rendezvous
        self._local = LocalClient()
        self._buffers: set[str] = set()
        self._reduction: StepReduction | None = None  # the step's buckets, from init
        self._specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._optimizers: tuple[Optimizer, ...] = ()  # each parameter group's, from init
        self._groups = ""  # agreement.groups_digest of init's groups

    @property
    def step(self) -> int:
        return self._local.step

    @step.setter
    def step(self, value: int) -> None:
        self._local.step = value

    @property
    def last_skipped(self) -> bool:
        return self._local.last_skipped

    def __enter__(self) -> AllReduceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops this worker's ring server; later calls raise ClientClosedError."""
        if self._reduction is not None:
            self._reduction.close()
        self.ring.close()
        self._local.close()
        self._rendezvous = None

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer | Sequence[Optimizer],
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
        fixed: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Starts every replica from worker 0's values (``optimizer`` and ``groups`` as
        ``PSClient.init``); ``fixed``'s arrays are overwritten with rank 0's too, in place.

        Raises:
            InvalidRequestError: embedding tables (they live on shards, and this mode has
                none), or workers disagree on the model.
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        if tables:
            raise InvalidRequestError(_NO_TABLES.format(sorted(tables)))
        arrays = {k: np.array(v, copy=True) for k, v in variables.items()}
        optimizers, group = resolve_groups(optimizer, groups, list(arrays))
        plan = BucketPlan.for_arrays(arrays, self.bucket_bytes)
        buckets = plan.flatten(arrays)
        for bucket in buckets:
            self.ring.broadcast(bucket, root=0, inplace=True)
        for array in (fixed or {}).values():
            self.ring.broadcast(array, root=0, inplace=True)
        self._local.init(plan.unflatten(buckets), optimizer, buffers, groups=groups)
        self._specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}
        self._buffers = set(buffers)
        self._optimizers = optimizers
        self._groups = agreement.groups_digest(group)
        extras = {
            SKIP_KEY: (1,),
            PUSHED_KEY: (len(self._specs),),
            agreement.AGREE_KEY: (self.num_workers, agreement.DIGEST_BYTES),
        }
        if self._reduction is not None:
            self._reduction.close()
        self._reduction = StepReduction(
            self.ring, self._specs, self._buffers, extras, self.compression, self.bucket_bytes
        )

    def pull(
        self, names: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """This replica's current values (identical on every worker); ``out`` as
        ``PSClient.pull``."""
        return self._local.pull(names, out)

    def keep_in(self, arrays: Mapping[str, np.ndarray]) -> None:
        """This replica's values held in ``arrays`` from now on (``LocalClient.keep_in``)."""
        self._local.keep_in(arrays)

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Refused: this mode holds no embedding tables.

        Raises:
            InvalidRequestError: always.
        """
        raise InvalidRequestError(_NO_TABLES.format([table]))

    def push(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        options: StepOptions | None = None,
    ) -> bool:
        """Averages this step's gradients over all workers and applies them locally, with
        this worker's ``options`` (every worker runs the same schedule); a skip by any
        worker (``options.skip``: its gradients are not sent) skips the step on every worker.

        A variable no worker pushed this step is left as it is (no optimizer step, as in
        torch for a ``None`` gradient, and as on the shards); one that some workers pushed
        counts as zeros from the others. The gradients, the step's flags, the buffers and the
        agreement digest travel in one collective; buckets ``start_bucket`` already sent are
        waited for and not sent again.

        Raises:
            UnknownVariableError: a name not in the model.
            ShapeMismatchError, InvalidRequestError: a gradient of another shape or dtype
                than its variable.
            ConfigError: a gradient appeared or went after ``start_bucket`` sent its bucket.
            HyperParameterMismatchError: ranks apply other optimizer settings or step
                hyper-parameters (named with their values); nothing was applied.
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        reduction = self._require_reduction()
        try:
            for name, grad in grads.items():
                if isinstance(grad, RowSparse):
                    raise InvalidRequestError(_NO_TABLES.format([name]))
                if name not in self._specs:
                    raise not_in_model(name, self._specs)
        except PSError as exc:
            reduction.abandon(exc)
            raise
        skip = bool(options and options.skip)
        dense = {n: np.asarray(g) for n, g in grads.items() if not isinstance(g, RowSparse)}
        sent = {n: g for n, g in dense.items() if n not in self._buffers and not skip}
        described = agreement.settings(group_optimizers(self._optimizers, options), self._groups)
        described[_PLAN_SETTING] = reduction.plan.digest()
        rank, world = self.worker_id, self.num_workers
        extras = {
            SKIP_KEY: np.array([1.0 if skip else 0.0], dtype=np.float32),
            PUSHED_KEY: np.array([n in grads for n in self._specs], dtype=np.float32),
            agreement.AGREE_KEY: agreement.agreement_tensor(rank, world, described),
            **{n: g for n, g in dense.items() if n in self._buffers},
        }
        mean = reduction.reduce(
            sent,
            extras,
            sums={agreement.AGREE_KEY},
            present=[n for n in grads if n not in self._buffers],
        )
        summed = mean.pop(agreement.AGREE_KEY)
        agreement.check(
            self.ring, rank, world, summed, described, self.step if step is None else step
        )
        pushed = dict(zip(self._specs, mean.pop(PUSHED_KEY) > 0, strict=True))
        mean = {n: v for n, v in mean.items() if n == SKIP_KEY or pushed[n]}
        if mean.pop(SKIP_KEY)[0] > 0:
            values = options.values if options is not None else {}
            options = StepOptions(values, skip=True)
            mean = {k: v for k, v in mean.items() if k in self._buffers}
        # The ring measured the large means as it wrote them: the step's checks reuse that.
        return self._local.push(mean, step, options, known_squares=reduction.measured)

    def gradient_buckets(self) -> list[list[str]]:
        """The variables of each gradient bucket, in the order buckets are reduced (the
        reverse of init's order, as backward makes gradients; buffers travel at ``push``).

        Raises:
            NotInitializedError: before ``init``.
        """
        plan = self._require_reduction().plan
        return [[slot.name for slot in bucket.slots] for bucket in plan.buckets]

    def reduce_in_turns(self) -> None:
        """From the next step on, sums each gradient bucket (then the step's own part) one
        after another, which lets ``start_bucket`` send them from backward's hooks: the same
        bits as summing them all at once. Every rank must call it before the same step (the
        ring waits for the parts in the order each rank runs them).

        Raises:
            NotInitializedError: before ``init``.
        """
        self._require_reduction().in_turns = True

    def start_bucket(self, index: int, grads: Mapping[str, np.ndarray]) -> None:
        """Sends gradient bucket ``index`` (``gradient_buckets``) now, in the background, for
        the step the next ``push`` ends (overlap: backward's hooks start each bucket as it
        fills). Buckets start in order; a bucket's absent gradients go as zeros, and must stay
        absent at ``push`` (which checks). A lone tensor in its bucket is read in place: it
        must not change until ``push`` returns.

        Raises:
            NotInitializedError: before ``init``.
            ConfigError: before ``reduce_in_turns``, or not the next bucket.
            ShapeMismatchError, InvalidRequestError: a gradient of another shape or dtype.
        """
        reduction = self._require_reduction()
        try:
            reduction.start(index, grads)
        except PSError as exc:
            reduction.abandon(exc)
            raise

    def sum_over_ranks(self, array: np.ndarray) -> np.ndarray:
        """``array`` summed over every rank (between steps; every rank must call it at the
        same point, as any collective), the same bits on each.

        Raises:
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        return self.ring.allreduce(np.ascontiguousarray(array, dtype=np.float64))

    def abandon_step(self, error: Exception) -> None:
        """Gives up a step whose buckets ``start_bucket`` sent but that will not be pushed
        (``error``, e.g. its gradients changed): the ring fails with ``error`` on every rank
        at once, rather than the others waiting out their timeout."""
        if self._reduction is not None:
            self._reduction.abandon(error)

    def _require_reduction(self) -> StepReduction:
        if self._reduction is None:
            raise NotInitializedError("init() must run before the first push")
        return self._reduction

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
        rows: Mapping[str, np.ndarray | Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """``push``, then ``pull`` (``psworker.api.push_then_pull``)."""
        return push_then_pull(self, grads, step, out, options, rows)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """This replica's optimizer slots (the same on every worker)."""
        return self._local.optimizer_state()

    def load_state(
        self,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        digest: str,
    ) -> None:
        """Every worker loads its own state; rank 0's then replaces the others' (values and
        slots, bit for bit), once every rank checked it loaded the same (``digest``).

        Raises:
            ModelMismatchError: this rank loaded another state than rank 0.
            UnknownVariableError, InvalidRequestError: a bad state.
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        mine = np.frombuffer(hashlib.sha256(digest.encode()).digest(), dtype=np.uint8)
        theirs = self.ring.broadcast(mine, root=0)
        if not np.array_equal(mine, theirs):
            raise ModelMismatchError(
                f"rank {self.worker_id} loaded another optimizer state than rank 0 (state "
                f"digest {digest}): load the same checkpoint on every rank"
            )
        self._local.load_state(values, slots)
        state = self._local.optimizer_state()
        arrays = dict(self._local.pull())
        arrays.update(
            {
                f"{k}\x00{n}": v
                for k, s in state.items()
                for n, v in s.items()
                if isinstance(v, np.ndarray)
            }
        )
        plan = BucketPlan.for_arrays(arrays, self.bucket_bytes)
        buckets = plan.flatten(arrays)
        for bucket in buckets:
            self.ring.broadcast(bucket, root=0, inplace=True)
        agreed = plan.unflatten(buckets)
        for key, slot_state in state.items():
            for name in slot_state:
                if isinstance(slot_state[name], np.ndarray):
                    slot_state[name] = agreed.pop(f"{key}\x00{name}")
        self._local.load_state(agreed, state)

    def heartbeat(self) -> None:
        """No servers to tell."""

    def status(self) -> list:
        return []
