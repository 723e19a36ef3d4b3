"""``mode="allreduce"``: no servers; workers average gradients over a gRPC ring, step locally."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pscore.optim import Optimizer
from pscore.optspec import StepOptions, group_optimizers, resolve_groups
from pscore.tables import RowSparse, Table
from pswire.codec import COMPRESSIONS, bfloat16_to_float32, float32_to_bfloat16
from pswire.errors import ConfigError, InvalidRequestError, ModelMismatchError, not_in_model
from pswire.security import ClientSecurity
from psworker.api import push_then_pull
from psworker.local import LocalClient
from psworker.ring import agreement
from psworker.ring.algorithm import DEFAULT_TIMEOUT_S
from psworker.ring.buckets import DEFAULT_BUCKET_BYTES, BucketPlan
from psworker.ring.ring import Ring, RingServer

# The skip flag travels in the gradients' all-reduce as one more tensor: a step any worker's
# GradScaler skipped is skipped by all, with no extra round.
SKIP_KEY = "\x00skip"
# One flag per variable: which names any worker pushed this step (the others are left as they
# are, as the shards leave a variable no worker pushed: another model's, a None gradient's).
PUSHED_KEY = "\x00pushed"
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
        self._plan: BucketPlan | None = None
        self._buckets: list[np.ndarray] = []  # the plan's buffers, reused every step
        self._ring_means: list[bool] = []  # per bucket: whether the ring itself averages it
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
    ) -> None:
        """Starts every replica from worker 0's values (``optimizer`` and ``groups`` as
        ``PSClient.init``).

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
        self._local.init(plan.unflatten(buckets), optimizer, buffers, groups=groups)
        self._specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}
        self._buffers = set(buffers)
        self._optimizers = optimizers
        self._groups = agreement.groups_digest(group)

    def pull(
        self, names: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """This replica's current values (identical on every worker); ``out`` as
        ``PSClient.pull``."""
        return self._local.pull(names, out)

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
        counts as zeros from the others.

        Raises:
            UnknownVariableError: a name not in the model.
            HyperParameterMismatchError: ranks apply other optimizer settings or step
                hyper-parameters (named with their values); nothing was applied.
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                raise InvalidRequestError(_NO_TABLES.format([name]))
            if name not in self._specs:
                raise not_in_model(name, self._specs)
        # Shapes from init, not a pull: a pull would copy the whole model every step.
        skip = bool(options and options.skip)
        full = {
            name: np.asarray(grads[name])
            if name in grads and (not skip or name in self._buffers)
            else np.zeros(shape, dtype)
            for name, (shape, dtype) in self._specs.items()
        }
        full[SKIP_KEY] = np.array([1.0 if skip else 0.0], dtype=np.float32)
        full[PUSHED_KEY] = np.array([n in grads for n in self._specs], dtype=np.float32)
        described = agreement.settings(group_optimizers(self._optimizers, options), self._groups)
        rank, world = self.worker_id, self.num_workers
        full[agreement.AGREE_KEY] = agreement.agreement_tensor(rank, world, described)
        mean = self._average(full, sums={agreement.AGREE_KEY})
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
        return self._local.push(mean, step, options)

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

    def _average(
        self, tensors: dict[str, np.ndarray], sums: set[str] | frozenset[str] = frozenset()
    ) -> dict[str, np.ndarray]:
        """The mean of each tensor over the ranks (the sum for names in ``sums``).

        Tensors travel in the plan's buckets, which live across steps (their memory is faulted
        in once). A bucket whose tensors all travel in their own float dtype is averaged by the
        ring itself (each rank divides the segment it completes) and its tensors come back as
        views of it, valid until the next call; other buckets (16-bit compression, integer
        buffers) are summed and divided here.
        """
        wire = {name: self._encode(name, t) for name, t in tensors.items()}
        if self._plan is None:
            self._plan = BucketPlan.for_arrays(wire, self.bucket_bytes)
            self._buckets = self._plan.empty()
            self._ring_means = [
                all(
                    tensors[slot.name].dtype == bucket.dtype and bucket.dtype.kind == "f"
                    for slot in bucket.slots
                )
                for bucket in self._plan.buckets
            ]
        # A bucket of one tensor is read from the tensor itself: no copy into the bucket.
        sources = self._plan.flatten(wire, out=self._buckets, sources=True)
        n = self.num_workers
        for bucket, source, mean in zip(self._buckets, sources, self._ring_means, strict=True):
            self.ring.allreduce(
                bucket,
                inplace=True,
                bfloat16=bucket.dtype == np.uint16,
                divisor=n if mean else 1,
                source=None if source is bucket else source,
            )
        summed = self._plan.unflatten(self._buckets)
        averaged = {
            s.name
            for b, m in zip(self._plan.buckets, self._ring_means, strict=True)
            if m
            for s in b.slots
        }
        out = {}
        for name, original in tensors.items():
            total = summed[name]
            if name in averaged:
                # The ring divided: a sum is the mean times n (exact for the agreement's bytes
                # and n a power of two, else equal wherever the sums are, which is what counts).
                out[name] = total * original.dtype.type(n) if name in sums else total
                continue
            if total.dtype == np.uint16:
                total = bfloat16_to_float32(total)
            if name in sums:
                out[name] = total.astype(original.dtype)
            elif original.dtype.kind == "f":
                out[name] = (total.astype(original.dtype) / original.dtype.type(n)).astype(
                    original.dtype
                )
            else:  # integer buffers (BatchNorm's num_batches_tracked), carried as float64
                out[name] = (total // n).astype(original.dtype)
        return out

    def _encode(self, name: str, tensor: np.ndarray) -> np.ndarray:
        if tensor.dtype.kind != "f":
            return tensor.astype(np.float64)
        if name in self._buffers or self.compression is None:
            return tensor
        if self.compression == "fp16":
            return tensor.astype(np.float16)
        if self.compression == "bf16":
            return float32_to_bfloat16(tensor.astype(np.float32))
        raise InvalidRequestError(f"unknown compression {self.compression!r}")  # pragma: no cover

    def heartbeat(self) -> None:
        """No servers to tell."""

    def status(self) -> list:
        return []
