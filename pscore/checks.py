"""The checks a tensor passes before it is used: a known dtype, sane dims and size, the
declared shape, and no NaN or Inf.

Both ends run them (a worker before it sends, a shard and the ``local`` client before a step),
so they are computation, not encoding: the wire's dtype names are the job description's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from pswire.errors import InvalidRequestError, ShapeMismatchError, TooLargeError

# Dims whose product exceeds this are nonsense whatever the memory (2**48 elements).
MAX_ELEMENTS = 1 << 48
DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"}
)
# bfloat16 has no numpy dtype: it travels as uint16 bit patterns (see ``pswire.codec``).
BFLOAT16 = "bfloat16"
# Looked up, not built, per tensor: a small step's whole budget is a few hundred microseconds,
# and numpy's dtype constructor and ``dtype.name`` cost microseconds each.
NUMPY_DTYPES = {
    name: np.dtype("uint16" if name == BFLOAT16 else name).newbyteorder("<") for name in DTYPES
}


def check_dtype(dtype: str, name: str) -> np.dtype:
    """Returns the little-endian numpy dtype for a wire dtype name.

    Raises:
        InvalidRequestError: the name is not a supported dtype.
    """
    dt = NUMPY_DTYPES.get(dtype)
    if dt is None:
        raise unsupported_dtype(dtype, name)
    return dt


def unsupported_dtype(dtype: str, name: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"variable '{name}' has unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}"
    )


def tensor_nbytes(name: str, dtype: str, shape: Iterable[int], limit: int | None = None) -> int:
    """Byte size of a tensor, validating every dim.

    Raises:
        InvalidRequestError: unknown dtype, a negative dim, or an absurd element count.
        TooLargeError: the tensor is larger than ``limit`` bytes.
    """
    dt = check_dtype(dtype, name)
    dims = tuple(map(int, shape))
    if dims and min(dims) < 0:
        raise InvalidRequestError(f"variable '{name}' has a negative dim in shape {dims}")
    count = math.prod(dims)
    # Zero dims are skipped: (0, 2**62) holds no elements, but numpy still refuses the shape.
    if (count or math.prod(d for d in dims if d)) > MAX_ELEMENTS:
        raise InvalidRequestError(
            f"variable '{name}' has shape {dims}: dims multiply past {MAX_ELEMENTS} elements"
        )
    nbytes = count * dt.itemsize
    if limit is not None and nbytes > limit:
        raise TooLargeError(
            f"variable '{name}' of shape {dims} is {nbytes} bytes, over the limit of {limit}"
        )
    return nbytes


def all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or Inf. A large, aligned float32/float64 array is
    first dotted with itself (``measured_squares``: one BLAS pass, no temporary): a finite
    result proves it; a NaN or Inf anywhere, or finite values large enough to overflow, fall
    through to the exact check. (Unaligned data, such as a tensor decoded in place from a
    message, would take numpy's non-BLAS loop: 847 us against 18 us for 1 MiB, bench/NOTES.md
    19.)"""
    squares = measured_squares(array)
    if squares is not None and np.isfinite(squares):
        return True
    return bool(np.isfinite(array).all())


def measured_squares(array: np.ndarray) -> float | None:
    """``sum_squares`` of a large, aligned, contiguous float32/float64 array (what
    ``all_finite`` measures it with); None for any other array, which is checked exactly."""
    if (
        array.size >= 1 << 16
        and array.dtype in (np.float32, np.float64)
        and array.flags.aligned
        and array.flags.c_contiguous
    ):
        return sum_squares(array)
    return None


def sum_squares(array: np.ndarray) -> float:
    """The sum of squares of a float array (one BLAS pass, no temporary): inf or NaN when it
    holds a non-finite value or values large enough to overflow it; 0 for other dtypes. A
    finite result proves every value finite (the optimizer's checks measure with it)."""
    if array.dtype.kind != "f":
        return 0.0
    flat = array.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(flat, flat))


# Many small float32 arrays (up to BATCH_ELEMENTS each, at least BATCH_ARRAYS of them) are
# checked for NaN/Inf in one pass over their concatenation: a step of 15,000 four-float
# variables spent most of its checks in per-array numpy calls.
BATCH_ARRAYS = 64
BATCH_ELEMENTS = 4096


def batched(array: np.ndarray) -> bool:
    """Whether ``array`` is checked with others (a small, non-empty float32 array)."""
    return array.dtype == np.float32 and 0 < array.size <= BATCH_ELEMENTS


def all_finite_together(arrays: Iterable[object]) -> bool:
    """Whether the ``batched`` arrays among ``arrays`` (anything else is skipped) hold no NaN
    or Inf, checked at once. False when they are too few to batch, or when some value is not
    finite: the caller then checks each array alone (and names the one that fails)."""
    batch = [a for a in arrays if isinstance(a, np.ndarray) and batched(a)]
    return len(batch) >= BATCH_ARRAYS and all_finite(np.concatenate(batch, axis=None))


def check_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    array: np.ndarray,
    what: str,
    finite: bool = False,
) -> float | None:
    """Checks ``array`` against a variable's declared shape and dtype, and for NaN/Inf
    (unless ``finite``: already known, e.g. from ``all_finite_together``).

    Returns:
        The array's sum of squares when the finite check measured it (``measured_squares``),
        so a caller that needs it (the optimizer's overflow guard) need not measure it
        again; else None.

    Raises:
        InvalidRequestError: wrong dtype or non-finite floats.
        ShapeMismatchError: wrong shape.
    """
    if array.dtype != check_dtype(dtype, name):
        raise InvalidRequestError(
            f"variable '{name}' has dtype {dtype} on the server, {what} sent {array.dtype}"
        )
    if tuple(array.shape) != tuple(shape):
        raise ShapeMismatchError(
            f"variable '{name}' has shape {tuple(shape)} on the server, {what} sent "
            f"{tuple(array.shape)}"
        )
    if finite or array.dtype.kind != "f":
        return None
    squares = measured_squares(array)
    if squares is not None and np.isfinite(squares):
        return squares
    if not np.isfinite(array).all():
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise InvalidRequestError(
            f"variable '{name}': {what} has {bad} non-finite values (NaN or Inf)"
        )
    return None
