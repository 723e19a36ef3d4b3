"""One step's all-reduce in mode allreduce: the gradients' buckets, then the step's own part
(flags, buffers, the agreement digest), in one collective, all at once or bucket by bucket.

The gradients travel in a fixed plan of buckets, the same on every rank: the variables in the
reverse of init's order (DDP's: the order backward makes their gradients, so the first bucket
fills first), at most ``bucket_bytes`` each. The step's part follows them: the skip flag, the
per-variable "pushed" flags, the buffers and the digest (``agreement``), which are only known
at ``step()``. ``reduce`` sums every bucket and the step's part in one pass of the ring
(``Ring.allreduce_many``). With ``in_turns`` (overlap) it sums them one after another
instead: ``start`` sends bucket k from backward's hooks in the background while backward goes
on, and ``reduce`` then sums what is left, a bucket at a time. Either way each bucket is a
part of one collective with its own segments (``algorithm.allreduce_many``), so each element
is summed in the same order: the same bits with overlap on and off. Every rank must reduce
alike (all ``in_turns`` or none: the same ``overlap`` on every rank), as the ring waits for
the parts in the order each rank runs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pswire.codec import bfloat16_to_float32, float32_to_bfloat16
from pswire.errors import (
    ClientClosedError,
    ConfigError,
    InvalidRequestError,
    ShapeMismatchError,
    WaitTimeoutError,
)
from psworker.ring.algorithm import Part
from psworker.ring.buckets import Bucket, BucketPlan
from psworker.ring.ring import Collective, Ring

# How long ``reduce`` waits for the buckets in flight beyond the ring's own timeout (which
# bounds each of their waits; a neighbour that trickles data keeps them going).
_SLACK_S = 60.0
_BF16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def wire_dtype(dtype: np.dtype, compression: str | None) -> np.dtype:
    """The dtype a tensor of ``dtype`` travels in: floats in their own dtype, or 16 bits with
    ``compression`` ("fp16", "bf16": bfloat16 as uint16 bits); other dtypes as float64."""
    if dtype.kind != "f":
        return np.dtype(np.float64)
    if compression == "fp16":
        return np.dtype(np.float16)
    if compression == "bf16":
        return _BF16
    return dtype


@dataclass
class _Started:
    """The buckets of this step that left from backward's hooks, in the background."""

    collective: Future[Collective]
    runs: list[Future[None]] = field(default_factory=list)
    # per started bucket: the names it carried a gradient of (the others went as zeros)
    carried: list[frozenset[str]] = field(default_factory=list)


class StepReduction:
    """The plans and buffers of a step's all-reduce (kept across steps: their memory is faulted
    in once), and the one background thread that runs buckets started from backward.

    ``specs`` are the model's variables in init's order, ``buffers`` the names among them
    averaged as values (they travel in the step's part), ``extras`` the step's own tensors
    (name -> shape, float32). Not thread-safe: one training thread calls it.
    """

    def __init__(
        self,
        ring: Ring,
        specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        buffers: Collection[str],
        extras: Mapping[str, tuple[int, ...]],
        compression: str | None,
        bucket_bytes: int,
    ) -> None:
        self._ring = ring
        self._n = ring.world_size
        self._compression = compression
        self._dtypes = {name: np.dtype(dtype) for name, (_, dtype) in specs.items()}
        self._dtypes.update({name: np.dtype(np.float32) for name in extras})
        self._buffer_names = frozenset(buffers)
        grads = {
            n: (shape, wire_dtype(np.dtype(d), compression))
            for n, (shape, d) in reversed(list(specs.items()))
            if n not in self._buffer_names
        }
        step = {n: (s, np.dtype(np.float32)) for n, s in extras.items()}
        step.update(
            {
                n: (shape, wire_dtype(np.dtype(d), None))
                for n, (shape, d) in specs.items()
                if n in self._buffer_names
            }
        )
        self.plan = BucketPlan.in_order(grads, bucket_bytes)
        self.step_plan = BucketPlan.build(step, bucket_bytes)
        self._buckets = self.plan.empty()
        self._step_buckets = self.step_plan.empty()
        self._pool: ThreadPoolExecutor | None = None
        self._started: _Started | None = None
        self._measured: dict[str, list[float]] = {}  # this step's sums of squares, by name
        self._closed = False
        # Each part summed alone, in order (overlap, set alike on every rank): a rank may then
        # start any number of buckets from backward, the ranks still exchange the same parts.
        self.in_turns = False

    @property
    def measured(self) -> dict[str, float]:
        """The last ``reduce``'s sums of squares of the means it measured as the ring wrote
        them (lone float32/float64 tensors the ring averaged), by name: the same value on
        every rank, valid until the next step."""
        return {name: got[0] for name, got in self._measured.items() if got}

    @property
    def started(self) -> int:
        """How many of this step's buckets have left (0: none, the step is not open)."""
        return 0 if self._started is None else len(self._started.runs)

    def names(self, index: int) -> list[str]:
        """The variables in gradient bucket ``index``."""
        return [slot.name for slot in self.plan.buckets[index].slots]

    # -- overlap: buckets from backward ------------------------------------------------------

    def start(self, index: int, grads: Mapping[str, np.ndarray]) -> None:
        """Copies gradient bucket ``index``'s tensors (absent ones as zeros; a lone tensor is
        read in place, so it must not change until ``reduce`` returns) and sums it in the
        background, after the buckets started before it.

        Raises:
            ClientClosedError: after ``close``.
            ConfigError: not ``in_turns``, or not the next bucket (buckets start in order:
                every rank must run the same collectives in the same order).
            ShapeMismatchError, InvalidRequestError: a tensor of another shape or dtype.
        """
        if self._closed:
            raise ClientClosedError("the all-reduce client was closed")
        if not self.in_turns:
            raise ConfigError(
                "buckets start from backward only when every rank reduces them in turns "
                "(in_turns, set by overlap=True on every rank)"
            )
        if index != self.started:
            raise ConfigError(
                f"gradient bucket {index} started while bucket {self.started} is the next: "
                "buckets start in the plan's order"
            )
        if self._started is None:
            self._measured = {}  # a new step
        part = self._part(self.plan.buckets[index], self._buckets[index], grads, index)
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPoolExecutor(1, thread_name_prefix="ring-buckets")
        if self._started is None:
            self._started = _Started(pool.submit(self._ring.open_collective))
        started = self._started
        started.runs.append(pool.submit(self._run, started.collective, [part]))
        names = {s.name for s in self.plan.buckets[index].slots}
        started.carried.append(frozenset(n for n in grads if n in names))

    @staticmethod
    def _run(collective: Future[Collective], parts: list[Part]) -> None:
        # In the pool's one thread, after the collective's opening: already resolved.
        _in_turns(collective.result(timeout=0), parts)

    def abandon(self, error: Exception) -> None:
        """Ends a step whose buckets started but that cannot finish (``error``): its
        collective is aborted with it at once (a bucket in flight fails with it), so the other
        ranks fail with this error instead of waiting out their timeout."""
        started, self._started = self._started, None
        if started is None or self._pool is None:
            return
        opening = started.collective
        if opening.done():
            if opening.exception() is None:
                opening.result().abort(error)  # the bucket in flight then fails with it
            return
        with contextlib.suppress(RuntimeError):  # the pool was shut down: the client closed
            self._pool.submit(lambda: opening.result().abort(error))

    # -- the step ----------------------------------------------------------------------------

    def reduce(
        self,
        grads: Mapping[str, np.ndarray],
        step: Mapping[str, np.ndarray],
        sums: Collection[str] = (),
        present: Collection[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """The mean over the ranks of every gradient (absent ones as zeros) and of the step's
        part (``step``: the extras and the buffers' values), the sum for names in ``sums``.
        ``present``: the gradients this step has (default ``grads``' names), which the
        buckets started from backward must have carried.

        Buckets started from backward are waited for; the rest go in one pass with the step's
        part. Results of buckets the ring averages are views of their buffers, valid until the
        next step.

        Raises:
            ConfigError: a started bucket carried other gradients than ``grads`` has now
                (one appeared or went after its bucket left).
            ShapeMismatchError, InvalidRequestError: a tensor of another shape or dtype.
            WaitTimeoutError, UnavailableError, PSError: a peer is silent or gone (named).
        """
        started, self._started = self._started, None
        if started is None:
            self._measured = {}
        try:
            done = 0 if started is None else len(started.runs)
            if started is not None:
                self._check_carried(started, grads if present is None else present)
            parts = [
                self._part(bucket, buffer, grads, index)
                for index, (bucket, buffer) in enumerate(
                    zip(self.plan.buckets, self._buckets, strict=True)
                )
                if index >= done
            ]
            first = len(self.plan.buckets)
            parts += [
                self._part(bucket, buffer, step, first + index)
                for index, (bucket, buffer) in enumerate(
                    zip(self.step_plan.buckets, self._step_buckets, strict=True)
                )
            ]
        except Exception as exc:
            if started is not None:
                self._started = started
                self.abandon(exc)
            raise
        if started is not None:
            self._finish(started, parts)
        elif self.in_turns:
            collective = self._ring.open_collective()
            _in_turns(collective, parts)
            collective.close()
        else:
            self._ring.allreduce_many(parts)
        out = self._values(self.plan, self._buckets, sums)
        out.update(self._values(self.step_plan, self._step_buckets, sums))
        return out

    def _finish(self, started: _Started, parts: list[Part]) -> None:
        """Waits for the started buckets, then sums ``parts`` and ends the collective.

        Raises:
            WaitTimeoutError: the buckets took longer than the ring's timeout and slack.
            PSError: what the ring raised.
        """
        assert self._pool is not None

        def rest() -> None:
            collective = started.collective.result(timeout=0)
            _in_turns(collective, parts)
            collective.close()

        runs: list[Future[Any]] = [started.collective, *started.runs]
        runs.append(self._pool.submit(rest))
        deadline = self._ring.timeout + _SLACK_S
        try:
            for run in runs:
                run.result(timeout=deadline)
        except TimeoutError:
            error = WaitTimeoutError(
                f"{self._ring.describe(self._ring.rank)}: the step's all-reduce took more than "
                f"{deadline:g} s"
            )
            self._started = started
            self.abandon(error)
            raise error from None

    def close(self) -> None:
        """Stops the background thread (a collective in flight ends on the ring's timeout or
        its close)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------

    def _check_carried(self, started: _Started, present: Collection[str]) -> None:
        for index, carried in enumerate(started.carried):
            names = self.names(index)
            now = frozenset(n for n in present if n in names)
            if now != carried:
                changed = sorted(now ^ carried)
                raise ConfigError(
                    f"gradients of {changed[:4]} appeared or went after their bucket (bucket "
                    f"{index}) left from backward: step() pushes other gradients than backward "
                    "made"
                )

    def _part(
        self, bucket: Bucket, buffer: np.ndarray, tensors: Mapping[str, np.ndarray], index: int
    ) -> Part:
        """Bucket ``index`` as a part of the step's collective: its values (a lone tensor read
        in place, else copied into ``buffer``; absent tensors as zeros), averaged by the ring
        when every tensor travels in its own float dtype.

        Raises:
            ShapeMismatchError, InvalidRequestError: as ``start``.
        """
        wires = {}
        for slot in bucket.slots:
            tensor = tensors.get(slot.name)
            if tensor is not None:
                wires[slot.name] = self._encode(slot.name, slot.shape, np.asarray(tensor))
        source = buffer
        lone = wires.get(bucket.slots[0].name) if len(bucket.slots) == 1 else None
        if lone is not None and lone.dtype == bucket.dtype and lone.flags.c_contiguous:
            source = lone.reshape(-1)
        else:
            for slot in bucket.slots:
                view = buffer[slot.offset : slot.offset + slot.size]
                wire = wires.get(slot.name)
                if wire is None:
                    view.fill(0)
                else:
                    np.copyto(view, wire.reshape(-1))
        mean = self._averaged(bucket)
        # A lone tensor the ring averages is measured as it is written: the step's checks
        # then need no pass of their own over it (``measured``).
        lone_mean = mean and len(bucket.slots) == 1 and bucket.dtype in (_F32, _F64)
        measure = self._measured.setdefault(bucket.slots[0].name, []) if lone_mean else None
        return Part(
            buffer,
            bfloat16=bucket.dtype == _BF16,
            divisor=self._n if mean else 1,
            source=None if source is buffer else source,
            measure=measure,
        )

    def _averaged(self, bucket: Bucket) -> bool:
        """Whether the ring itself averages the bucket: every tensor travels as its own
        float dtype (each rank divides the segment it completes); else the sum is divided
        here."""
        return bucket.dtype.kind == "f" and all(
            self._dtypes[s.name] == bucket.dtype for s in bucket.slots
        )

    def _encode(self, name: str, shape: tuple[int, ...], tensor: np.ndarray) -> np.ndarray:
        """``tensor`` in its wire dtype, checked against the variable.

        Raises:
            ShapeMismatchError: another shape.
            InvalidRequestError: another dtype.
        """
        dtype = self._dtypes[name]
        if tensor.dtype != dtype:
            raise InvalidRequestError(
                f"variable '{name}' has dtype {dtype}, the push sent {tensor.dtype}"
            )
        if tensor.shape != shape:
            raise ShapeMismatchError(
                f"variable '{name}' has shape {shape}, the push sent {tensor.shape}"
            )
        wire = wire_dtype(dtype, None if name in self._buffer_names else self._compression)
        if wire == dtype:
            return tensor
        if wire == _BF16:
            return float32_to_bfloat16(tensor.astype(np.float32))
        return tensor.astype(wire)

    def _values(
        self, plan: BucketPlan, buffers: Sequence[np.ndarray], sums: Collection[str]
    ) -> dict[str, np.ndarray]:
        """Each tensor's mean (the sum for ``sums``) from the summed buckets, in its own
        dtype: views of the buffers where the ring averaged."""
        n = self._n
        out = {}
        for bucket, buffer in zip(plan.buckets, buffers, strict=True):
            averaged = self._averaged(bucket)
            for slot in bucket.slots:
                name, dtype = slot.name, self._dtypes[slot.name]
                total = buffer[slot.offset : slot.offset + slot.size].reshape(slot.shape)
                if averaged:
                    # The ring divided: a sum is the mean times n (exact for the agreement's
                    # bytes and n a power of two, else equal wherever the sums are, which is
                    # what counts).
                    out[name] = total * dtype.type(n) if name in sums else total
                    continue
                if total.dtype == _BF16:
                    total = bfloat16_to_float32(total)
                if name in sums:
                    out[name] = total.astype(dtype)
                elif dtype.kind == "f":
                    out[name] = (total.astype(dtype) / dtype.type(n)).astype(dtype)
                else:  # integer buffers (BatchNorm's num_batches_tracked), carried as float64
                    out[name] = (total // n).astype(dtype)
        return out


def _in_turns(collective: Collective, parts: Sequence[Part]) -> None:
    """Sums ``parts`` one after another (each its own turn: see ``in_turns``)."""
    for part in parts:
        collective.allreduce([part])
