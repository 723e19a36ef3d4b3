"""Gradient buckets: many named tensors packed into few flat buffers, the same on every worker."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from pswire.errors import InvalidRequestError, ShapeMismatchError, UnknownVariableError

# torch DDP's default bucket size: few ring rounds for a model of many small tensors.
DEFAULT_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in its bucket: elements ``[offset, offset + size)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of one dtype holding several tensors, reduced as one unit."""

    dtype: np.dtype
    slots: tuple[Slot, ...]
    size: int

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """Packs named tensors into few flat buffers and back; the same on every worker.

    The plan depends only on the names, shapes and dtypes (sorted by dtype, then name), never
    on dict order, so workers holding the same model agree without talking.
    """

    buckets: tuple[Bucket, ...]

    @classmethod
    def build(
        cls,
        specs: Mapping[str, tuple[Sequence[int], DTypeLike]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> BucketPlan:
        """Plans buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket alone),
        sorted by dtype, then name: the same plan whatever order each worker lists them in.

        Args:
            specs: name -> (shape, dtype).
            bucket_bytes: the most bytes a bucket holds unless one tensor alone is larger.

        Raises:
            ValueError: ``bucket_bytes`` < 1 or a negative dim.
        """
        entries = _entries(specs, bucket_bytes)
        entries.sort(key=lambda e: (e[0].str, e[1]))
        return cls(_pack(entries, bucket_bytes))

    @classmethod
    def in_order(
        cls,
        specs: Mapping[str, tuple[Sequence[int], DTypeLike]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> BucketPlan:
        """Plans buckets as ``build``, but in ``specs``' own order (a new bucket also where
        the dtype changes): DDP's plan, the tensors in the order backward makes their
        gradients, so the first bucket fills first. Workers must list them alike (the same
        model gives the same order; ``digest`` tells plans apart).

        Raises:
            ValueError: ``bucket_bytes`` < 1 or a negative dim.
        """
        return cls(_pack(_entries(specs, bucket_bytes), bucket_bytes))

    def digest(self) -> str:
        """The plan (each bucket's dtype and tensors: names, shapes, places) as a short
        digest, equal on workers whose plans are equal."""
        text = repr([(b.dtype.str, b.slots) for b in self.buckets])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def for_arrays(
        cls, tensors: Mapping[str, np.ndarray], bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> BucketPlan:
        """The plan for these arrays' names, shapes and dtypes (see ``build``)."""
        return cls.build({n: (t.shape, t.dtype) for n, t in tensors.items()}, bucket_bytes)

    @property
    def names(self) -> list[str]:
        return [s.name for b in self.buckets for s in b.slots]

    def empty(self) -> list[np.ndarray]:
        """New, uninitialised flat buffers, one per bucket (to reuse with ``flatten(out=)``)."""
        return [np.empty(bucket.size, dtype=bucket.dtype) for bucket in self.buckets]

    def flatten(
        self,
        tensors: Mapping[str, np.ndarray],
        out: Sequence[np.ndarray] | None = None,
        sources: bool = False,
    ) -> list[np.ndarray]:
        """Copies the tensors into flat buffers, one per bucket: ``out``'s (from ``empty``:
        a step's buckets reuse memory already faulted in) or new ones.

        With ``sources`` a bucket that holds one C-contiguous tensor is not copied: its entry
        is a flat view of that tensor (for an out-of-place all-reduce reading it).

        Raises:
            UnknownVariableError: a planned tensor is missing or an unplanned one is given.
            ShapeMismatchError: a tensor's shape differs from the plan.
            InvalidRequestError: a tensor's dtype differs from the plan, or ``out`` does not
                match it.
        """
        if out is not None:
            self._check_buffers(out)
        extra = set(tensors) - set(self.names)
        if extra:
            raise UnknownVariableError(f"tensors {sorted(extra)} are not in the bucket plan")
        buffers = []
        for index, bucket in enumerate(self.buckets):
            checked = [(slot, self._checked(bucket, slot, tensors)) for slot in bucket.slots]
            if sources and len(checked) == 1 and checked[0][1].flags.c_contiguous:
                buffers.append(checked[0][1].reshape(-1))
                continue
            buffer = np.empty(bucket.size, dtype=bucket.dtype) if out is None else out[index]
            for slot, tensor in checked:
                np.copyto(buffer[slot.offset : slot.offset + slot.size], tensor.reshape(-1))
            buffers.append(buffer)
        return buffers

    @staticmethod
    def _checked(bucket: Bucket, slot: Slot, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """The tensor for ``slot``, checked against the plan.

        Raises:
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: as ``flatten``.
        """
        if slot.name not in tensors:
            raise UnknownVariableError(
                f"tensor '{slot.name}' is in the bucket plan but was not given"
            )
        tensor = np.asarray(tensors[slot.name])
        if tensor.shape != slot.shape:
            raise ShapeMismatchError(
                f"tensor '{slot.name}' has shape {tensor.shape}, the bucket plan "
                f"expects {slot.shape}"
            )
        if tensor.dtype != bucket.dtype:
            raise InvalidRequestError(
                f"tensor '{slot.name}' has dtype {tensor.dtype}, the bucket plan "
                f"expects {bucket.dtype}"
            )
        return tensor

    def unflatten(self, buffers: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Splits bucket buffers back into named tensors (views into the buffers, no copy).

        Raises:
            InvalidRequestError: the buffers do not match the plan's count, sizes or dtypes.
        """
        self._check_buffers(buffers)
        out: dict[str, np.ndarray] = {}
        for bucket, buffer in zip(self.buckets, buffers, strict=True):
            for slot in bucket.slots:
                out[slot.name] = buffer[slot.offset : slot.offset + slot.size].reshape(slot.shape)
        return out

    def _check_buffers(self, buffers: Sequence[np.ndarray]) -> None:
        """Raises InvalidRequestError unless ``buffers`` match the plan's count, sizes, dtypes."""
        if len(buffers) != len(self.buckets):
            raise InvalidRequestError(
                f"got {len(buffers)} buffers for a plan of {len(self.buckets)} buckets"
            )
        for i, (bucket, buffer) in enumerate(zip(self.buckets, buffers, strict=True)):
            if buffer.shape != (bucket.size,) or buffer.dtype != bucket.dtype:
                raise InvalidRequestError(
                    f"bucket {i} is {buffer.shape} {buffer.dtype}, the plan expects "
                    f"({bucket.size},) {bucket.dtype}"
                )


def _entries(
    specs: Mapping[str, tuple[Sequence[int], DTypeLike]], bucket_bytes: int
) -> list[tuple[np.dtype, str, tuple[int, ...]]]:
    """``specs`` as (dtype, name, dims), checked.

    Raises:
        ValueError: ``bucket_bytes`` < 1 or a negative dim.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    entries = []
    for name, (shape, dtype) in specs.items():
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor '{name}' has a negative dim in shape {dims}")
        entries.append((np.dtype(dtype), name, dims))
    return entries


def _pack(
    entries: Sequence[tuple[np.dtype, str, tuple[int, ...]]], bucket_bytes: int
) -> tuple[Bucket, ...]:
    """Fills buckets in ``entries``' order: a new one where the dtype changes or the next
    tensor would take it past ``bucket_bytes``."""
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    size = 0
    current: np.dtype | None = None
    for dtype, name, dims in entries:
        count = int(np.prod(dims, dtype=np.int64))
        full = size > 0 and (size + count) * dtype.itemsize > bucket_bytes
        if current is not None and (dtype != current or full):
            buckets.append(Bucket(current, tuple(slots), size))
            slots, size = [], 0
        current = dtype
        slots.append(Slot(name, dims, size, count))
        size += count
    if current is not None:
        buckets.append(Bucket(current, tuple(slots), size))
    return tuple(buckets)
