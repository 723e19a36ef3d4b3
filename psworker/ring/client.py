"""``mode="allreduce"``: no servers; workers average gradients over a gRPC ring, step locally."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pswire.codec import COMPRESSIONS, bfloat16_to_float32, float32_to_bfloat16
from pswire.errors import ConfigError, InvalidRequestError, not_in_model
from pswire.optim import Optimizer
from pswire.security import ClientSecurity
from pswire.tables import RowSparse, Table
from psworker.api import PushThenPull
from psworker.local import LocalClient
from psworker.ring.algorithm import DEFAULT_TIMEOUT_S
from psworker.ring.buckets import DEFAULT_BUCKET_BYTES, BucketPlan
from psworker.ring.ring import Ring, RingServer

_NO_TABLES = (
    "embedding tables {} live on parameter-server shards; mode 'allreduce' has none "
    "(use sync, async, ssp or local)"
)


class AllReduceClient(PushThenPull):
    """The ``Client`` role without shards; every worker holds a full replica (like Horovod or DDP).

    ``init`` broadcasts worker 0's values so replicas start bit-identical. ``push`` sums the
    gradients over the ring in buckets of ``bucket_bytes`` (the same plan on every worker),
    divides by the worker count, and applies the optimizer locally with the shards' math, so
    every replica takes the same step. ``compression`` ("fp16" or "bf16") sends gradients in
    16 bits; the ring accumulates them in float32. Buffers are averaged the same way.
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
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.worker_id = rank
        self.num_workers = len(peers)
        self.addresses = list(peers)
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        self.ring = Ring(rank, peers, timeout=timeout, server=server, security=security)
        self._local = LocalClient()
        self._buffers: set[str] = set()
        self._plan: BucketPlan | None = None
        self._specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}

    @property
    def step(self) -> int:
        return self._local.step

    @step.setter
    def step(self, value: int) -> None:
        self._local.step = value

    def __enter__(self) -> AllReduceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops this worker's ring server; later calls raise ClientClosedError."""
        self.ring.close()
        self._local.close()

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer,
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
    ) -> None:
        """Starts every replica from worker 0's values.

        Raises:
            InvalidRequestError: embedding tables (they live on shards, and this mode has
                none), or workers disagree on the model.
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        if tables:
            raise InvalidRequestError(_NO_TABLES.format(sorted(tables)))
        arrays = {k: np.array(v, copy=True) for k, v in variables.items()}
        plan = BucketPlan.for_arrays(arrays, self.bucket_bytes)
        buckets = plan.flatten(arrays)
        for bucket in buckets:
            self.ring.broadcast(bucket, root=0, inplace=True)
        self._local.init(plan.unflatten(buckets), optimizer, buffers)
        self._specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}
        self._buffers = set(buffers)

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

    def push(self, grads: Mapping[str, np.ndarray | RowSparse], step: int | None = None) -> bool:
        """Averages this step's gradients over all workers and applies them locally.

        Every worker must push the same names each step; a parameter with no gradient on
        this worker counts as zeros (pass all of them).

        Raises:
            UnknownVariableError: a name not in the model.
            WaitTimeoutError, UnavailableError: a peer is silent or gone (named).
        """
        for name, grad in grads.items():
            if isinstance(grad, RowSparse):
                raise InvalidRequestError(_NO_TABLES.format([name]))
            if name not in self._specs:
                raise not_in_model(name, self._specs)
        # Shapes from init, not a pull: a pull would copy the whole model every step.
        full = {
            name: np.asarray(grads[name]) if name in grads else np.zeros(shape, dtype)
            for name, (shape, dtype) in self._specs.items()
        }
        mean = self._average(full)
        return self._local.push(mean, step)

    def _average(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        wire = {name: self._encode(name, t) for name, t in tensors.items()}
        if self._plan is None:
            self._plan = BucketPlan.for_arrays(wire, self.bucket_bytes)
        buckets = self._plan.flatten(wire)
        for bucket in buckets:
            self.ring.allreduce(bucket, inplace=True, bfloat16=bucket.dtype == np.uint16)
        summed = self._plan.unflatten(buckets)
        n = self.num_workers
        out = {}
        for name, original in tensors.items():
            total = summed[name]
            if total.dtype == np.uint16:
                total = bfloat16_to_float32(total)
            if original.dtype.kind == "f":
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
