"""Row-sparse embedding tables: their description, checks, seeded rows and rows from a file.

Shared by the shards and the clients, which must agree on all of it: a slice's ids, the
initial value of every row (a pure function of the seed and the id, so a row is the same on
any shard, after an eviction, and in ``local`` mode; or a fixed table's rows read from a file,
``rows_from_file``). Which shard holds an id is the client's
business (``psworker.placement``); the row storage and sparse optimizer step are
``pscore.rowstore``; the wire form is ``pswire.jobspec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from pscore.checks import all_finite
from pscore.optim import Optimizer
from pswire.errors import ConfigError, InvalidRequestError, TooLargeError

INITS = ("normal", "uniform", "zeros")
TABLE_DTYPES = ("float32", "float64")
ROW_FILES = (".safetensors", ".npy")  # what ``init_from`` reads (see ``rows_from_file``)
# A dynamic table's ids in a file of its rows: the table's rows under its name, their ids
# under its name and this suffix (what ``psctl export`` writes; ``init_from`` reads).
IDS_SUFFIX = ".ids"
# The rows a dynamic table's file is read in, at most: each shard keeps its own ids' rows.
_FILE_BLOCK_BYTES = 1 << 26
_SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64"}
# Column pairs initialised per block: the block's scratch (two uint64, three float32 and one
# uint32 arrays, 1 MiB) stays in a core's cache through the passes that draw it.
_INIT_BLOCK_PAIRS = 1 << 15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Table:
    """An embedding table as a model declares it.

    ``num_rows`` None: a dynamic table whose ids are any int64 (e.g. feature hashes); rows are
    created on first touch, and with ``capacity`` > 0 each shard keeps at most that many rows,
    evicting the least recently used. Otherwise ids are ``0..num_rows-1``, split into contiguous
    ranges across the shards. Rows start as ``init`` ("normal": N(0, init_scale**2), like
    ``torch.nn.Embedding`` with the default scale 1; "uniform": U(-init_scale, init_scale);
    "zeros"), drawn from ``(seed, id)`` alone.

    ``init_from``: the table's rows come from a file instead, read by each shard (its own
    ids) when the table is made. A fixed table's: a ``.safetensors`` file holding a
    ``(num_rows, dim)`` tensor under the table's name (what ``psctl export --out
    model.safetensors`` writes), or a ``.npy`` file of that array. A dynamic table's: a
    ``.safetensors`` file holding its rows ``(n, dim)`` under its name and their distinct int64
    ids ``(n,)`` under its name plus ``IDS_SUFFIX`` (what ``psctl export`` writes), least
    recently used first; every other id starts from ``init`` as before. Where the file holds
    the rows' optimizer state too (``slot_key``: what ``psctl export`` writes), the rows go on
    with it; else it starts fresh. So a table trained on some shard count goes on, as if
    uninterrupted, on another. A relative path is made absolute here, as the worker sees it.
    """

    num_rows: int | None
    dim: int
    dtype: str = "float32"
    init: str = "normal"
    init_scale: float = 1.0
    seed: int = 0
    capacity: int = 0
    init_from: str = ""

    def __post_init__(self) -> None:
        if self.num_rows is not None and self.num_rows < 1:
            raise ConfigError(f"num_rows must be >= 1 or None (dynamic), got {self.num_rows}")
        if self.dim < 1:
            raise ConfigError(f"dim must be >= 1, got {self.dim}")
        if self.dtype not in TABLE_DTYPES:
            raise ConfigError(f"table dtype must be one of {TABLE_DTYPES}, got {self.dtype!r}")
        if self.init not in INITS:
            raise ConfigError(f"init must be one of {INITS}, got {self.init!r}")
        if not np.isfinite(self.init_scale) or self.init_scale < 0:
            raise ConfigError(f"init_scale must be finite and >= 0, got {self.init_scale}")
        if self.capacity < 0 or (self.capacity and self.num_rows is not None):
            raise ConfigError("capacity is for dynamic tables (num_rows=None) and must be >= 0")
        if not 0 <= self.seed <= _MASK64:
            raise ConfigError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.init_from:
            why = _row_file_problem(self.init_from, self.num_rows or 0)
            if why:
                raise ConfigError(f"init_from {self.init_from!r}: {why}")
            object.__setattr__(self, "init_from", str(Path(self.init_from).absolute()))

    @property
    def dynamic(self) -> bool:
        return self.num_rows is None

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TableSlice:
    """One shard's part of a table: ids ``[row_start, row_end)`` of a fixed table, or the ids
    that hash to this shard of a dynamic one (``num_rows`` 0)."""

    key: str
    dim: int
    dtype: str = "float32"
    num_rows: int = 0  # 0: dynamic
    row_start: int = 0
    row_end: int = 0
    capacity: int = 0
    init: str = "normal"
    init_scale: float = 1.0
    seed: int = 0
    init_from: str = ""  # a file of the whole table's rows (Table.init_from)

    @property
    def dynamic(self) -> bool:
        return self.num_rows == 0

    @property
    def local_rows(self) -> int:
        return self.row_end - self.row_start

    def check(self, optimizer: Optimizer) -> None:
        """Validates the slice and that ``optimizer`` has a row-sparse form.

        Raises:
            InvalidRequestError: naming the table and the bad value.
        """
        where = f"table '{self.key}'"
        if self.dim < 1 or self.dtype not in TABLE_DTYPES or self.init not in INITS:
            raise InvalidRequestError(
                f"{where}: dim {self.dim}, dtype {self.dtype!r}, init {self.init!r}; expected "
                f"dim >= 1, dtype in {TABLE_DTYPES}, init in {INITS}"
            )
        if self.num_rows < 0 or self.capacity < 0 or not np.isfinite(self.init_scale):
            raise InvalidRequestError(
                f"{where}: num_rows {self.num_rows}, capacity {self.capacity} and init_scale "
                f"{self.init_scale} must be >= 0 and finite"
            )
        if not self.dynamic and not 0 <= self.row_start <= self.row_end <= self.num_rows:
            raise InvalidRequestError(
                f"{where}: rows [{self.row_start}, {self.row_end}) are not within "
                f"[0, {self.num_rows})"
            )
        why = _row_file_problem(self.init_from, self.num_rows) if self.init_from else ""
        if why:
            raise InvalidRequestError(f"{where}: init_from {self.init_from!r}: {why}")
        if not optimizer.sparse:
            raise InvalidRequestError(
                f"{where}: optimizer {optimizer.name!r} has no row-sparse form (torch has no "
                "sparse one either); train embedding tables with sgd, adam, adamw, adagrad or "
                "rmsprop (another parameter group or model may use it)"
            )
        decay = getattr(optimizer, "weight_decay", 0.0)
        if decay:
            raise InvalidRequestError(
                f"{where}: weight_decay {decay} has no row-sparse form (it "
                "would decay rows a step never touched); torch's sparse optimizers refuse it too"
            )


def _row_file_problem(path: str, num_rows: int) -> str:
    """Why ``path`` cannot be a table's ``init_from`` ("" if it can, as far as its name says)."""
    suffixes = ROW_FILES if num_rows else (".safetensors",)  # a dynamic table: rows and ids
    if Path(path).suffix not in suffixes:
        kind = "a fixed" if num_rows else "a dynamic"
        return f"{kind} table's rows come from a file ending in one of {suffixes}"
    return ""


def slot_key(table: str, slot: str) -> str:
    """The name of table ``table``'s optimizer slot ``slot`` (Adam's ``exp_avg``, a row per
    row of the table; its ``step``, a 0-d int64 count) in a file of its rows, beside them."""
    return f"{table}.{slot}"


def rows_from_file(
    spec: TableSlice, shard: int = 0, num_shards: int = 1, optimizer: Optimizer | None = None
) -> tuple[np.ndarray | None, np.ndarray, dict[str, Any]]:
    """This slice's rows from its table's ``init_from`` file, read on this host, and their
    optimizer state where the file holds it: (None, rows ``[row_start, row_end)``, state)
    for a fixed table, of which only that range is read (a read-only view of a mapped .npy
    file; copy it); (ids, their rows, state), least recently used first, for a dynamic one:
    the file's ids that ``dynamic_home`` puts on shard ``shard`` of ``num_shards``, read a
    block of rows at a time.

    ``optimizer``: the table's, whose slots (``Optimizer.make_state``: an array, or None
    where made lazily, per row; a number for a count) are read. The state holds, by slot, a
    row-shaped array
    of the table's dtype for each array slot, in the rows' order (read as ``slot_key``
    names it), and an int for each count; or nothing (``{}``: the state starts fresh) where
    the file holds none of the array slots (a ``.npy`` file, a ``model.state_dict()``,
    another optimizer's export).

    Raises:
        InvalidRequestError: naming the table and the file: it cannot be read here, holds no
            such tensor, or one of another shape or dtype than the table's, a row (or a row's
            state) that is not finite, ids that repeat, more rows for this shard than its
            capacity, or some of the optimizer's slots only.
    """
    where = f"table '{spec.key}': init_from {spec.init_from!r}"
    if spec.dynamic and num_shards < 1:
        raise InvalidRequestError(
            f"{where}: the job does not say which shard of how many this is, so it cannot "
            "tell which of the file's ids are its own (a worker older than this shard?)"
        )
    state: dict[str, Any] = {}
    slots = {} if optimizer is None else optimizer.make_state(np.zeros((0, spec.dim), spec.dtype))
    try:
        if spec.dynamic:
            ids, rows = _read_held_rows(spec, where, shard, num_shards, slots, state)
        else:
            ids, rows = None, _read_rows(spec, where, slots, state)
    except (OSError, ValueError, SafetensorError) as exc:
        raise InvalidRequestError(f"{where} could not be read on this host: {exc}") from exc
    for key, array in {spec.key: rows, **state}.items():
        if isinstance(array, np.ndarray) and array.ndim == 2 and not all_finite(array):
            bad = int(np.flatnonzero(~np.isfinite(array).all(axis=1))[0])
            row = spec.row_start + bad if ids is None else f"of id {int(ids[bad])}"
            what = "row" if key == spec.key else f"'{key}' (optimizer state) of row"
            raise InvalidRequestError(f"{where}: {what} {row} is not finite")
    if spec.capacity and ids is not None and len(ids) > spec.capacity:
        raise InvalidRequestError(
            f"{where} holds {len(ids)} rows for shard {shard} of {num_shards}, over the "
            f"table's capacity of {spec.capacity} rows a shard: raise capacity to at least "
            f"{len(ids)} or start more shards"
        )
    named = {k: state.get(slot_key(spec.key, k)) for k in slots}
    return ids, rows, {k: v if v.ndim else int(v) for k, v in named.items() if v is not None}


def dynamic_home(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard holding each id of a dynamic table: ``splitmix64(id) % num_shards``."""
    if num_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return (splitmix64(ids.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)


def _read_rows(
    spec: TableSlice, where: str, slots: Mapping[str, Any], state: dict[str, Any]
) -> np.ndarray:
    """A fixed slice's rows from its file (InvalidRequestError: not the table's), and into
    ``state`` their optimizer state where the file holds it (``rows_from_file``)."""
    expected = (spec.num_rows, spec.dim)
    if spec.init_from.endswith(".npy"):
        whole = np.load(spec.init_from, mmap_mode="r", allow_pickle=False)
        _check_tensor(where, spec.key, whole.shape, str(whole.dtype), expected, spec.dtype)
        return whole[spec.row_start : spec.row_end]  # mapped, read-only
    with safe_open(spec.init_from, framework="np") as f:
        for key in [spec.key, *_state_keys(f, spec, where, slots, state)]:
            piece = _tensor(f, where, key, "the table's name")
            _check_tensor(where, key, *_shape_dtype(piece), expected, spec.dtype)
            state[key] = piece[spec.row_start : spec.row_end]
        return state.pop(spec.key)


def _state_keys(
    f: Any, spec: TableSlice, where: str, slots: Mapping[str, Any], state: dict[str, Any]
) -> list[str]:
    """The names of the table's row-shaped optimizer slots in open file ``f``, all or none
    (InvalidRequestError: some only); its counts, read into ``state``."""
    names = set(f.keys())
    rows = [slot_key(spec.key, k) for k, v in slots.items() if v is None or hasattr(v, "shape")]
    held = [k for k in rows if k in names]
    if not held:
        return []
    counts = [slot_key(spec.key, k) for k in slots if slot_key(spec.key, k) not in rows]
    missing = sorted(set(rows + counts) - names)
    if missing:
        raise InvalidRequestError(
            f"{where} holds the optimizer state {sorted(held)} but not {missing}: the "
            "table's optimizer keeps both (written by another optimizer? drop the state from "
            "the file to start it fresh)"
        )
    for key in counts:
        count = f.get_tensor(key)
        if count.dtype != np.int64 or count.shape != () or int(count) < 0:
            raise InvalidRequestError(
                f"{where} holds '{key}' of dtype {count.dtype} and shape {count.shape}; a "
                "count of optimizer steps is a 0-d int64 of at least 0"
            )
        state[key] = np.asarray(count, np.int64)
    return held


def _read_held_rows(
    spec: TableSlice,
    where: str,
    shard: int,
    num_shards: int,
    slots: Mapping[str, Any],
    state: dict[str, Any],
) -> tuple[np.ndarray, np.ndarray]:
    """A dynamic slice's ids and rows from its file (InvalidRequestError: not the table's),
    and into ``state`` their optimizer state where the file holds it (``rows_from_file``)."""
    with safe_open(spec.init_from, framework="np") as f:
        id_key = spec.key + IDS_SUFFIX
        _tensor(f, where, id_key, "the table's ids")
        ids = f.get_tensor(id_key)
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise InvalidRequestError(
                f"{where}: '{id_key}' holds {ids.dtype} of shape {ids.shape}; a dynamic "
                "table's ids are 1-d int64"
            )
        unique, counts = np.unique(ids, return_counts=True)
        if len(unique) < len(ids):
            raise InvalidRequestError(
                f"{where}: id {int(unique[np.argmax(counts > 1)])} is in '{id_key}' "
                f"{int(counts.max())} times; a table's ids are distinct"
            )
        mine = np.flatnonzero(dynamic_home(ids, num_shards) == shard)  # sorted
        for key in [spec.key, *_state_keys(f, spec, where, slots, state)]:
            piece = _tensor(f, where, key, "the table's name")
            _check_tensor(where, key, *_shape_dtype(piece), (len(ids), spec.dim), spec.dtype)
            rows = np.empty((len(mine), spec.dim), dtype=spec.dtype)
            block = max(1, _FILE_BLOCK_BYTES // (spec.dim * rows.itemsize))
            starts = range(0, len(ids), block)
            ends = [min(start + block, len(ids)) for start in starts]  # none past the end
            cuts = np.searchsorted(mine, ends)  # this shard's rows in each block
            for start, end, lo, hi in zip(starts, ends, [0, *cuts[:-1]], cuts, strict=True):
                if hi > lo:
                    rows[lo:hi] = piece[start:end][mine[lo:hi] - start]
            state[key] = rows
        return ids[mine], state.pop(spec.key)


def _tensor(f: Any, where: str, key: str, what: str) -> Any:
    """The slice of tensor ``key`` in an open safetensors file (InvalidRequestError: none)."""
    names = f.keys()
    if key not in names:
        raise InvalidRequestError(
            f"{where} holds no tensor '{key}' ({what}): it holds {sorted(names)[:20]}"
        )
    return f.get_slice(key)


def _shape_dtype(piece: Any) -> tuple[tuple[int, ...], str]:
    return tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())


def _check_tensor(
    where: str,
    key: str,
    shape: tuple[int, ...],
    dtype: str,
    expected: tuple[int, ...],
    expected_dtype: str,
) -> None:
    if shape != expected or dtype != expected_dtype:
        raise InvalidRequestError(
            f"{where} holds a tensor '{key}' of shape {shape} and dtype {dtype}; the table is "
            f"{expected} {expected_dtype}"
        )


def check_rows(spec: TableSlice, ids: np.ndarray, values: np.ndarray | None, what: str) -> None:
    """Checks row ids (and a gradient's rows) against one shard's slice of a table.

    Raises:
        InvalidRequestError: an id this slice does not hold (naming it), rows of the wrong
            shape or dtype, a length mismatch, or non-finite values.
        TooLargeError: more rows than a dynamic slice's capacity.
    """
    where = f"table '{spec.key}'"
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise InvalidRequestError(f"{where}: {what} ids must be 1-d int64, got {ids.dtype}")
    if spec.dynamic:
        if spec.capacity and len(ids) > spec.capacity:
            distinct = len(np.unique(ids))
            if distinct > spec.capacity:
                raise TooLargeError(
                    f"{where}: {what} touches {distinct} rows, over this shard's capacity of "
                    f"{spec.capacity}"
                )
    elif len(ids) and (ids.min() < spec.row_start or ids.max() >= spec.row_end):
        bad = (ids < spec.row_start) | (ids >= spec.row_end)
        if bad.any():
            raise InvalidRequestError(
                f"{where}: {what} has id {int(ids[np.argmax(bad)])}, but this shard holds ids "
                f"[{spec.row_start}, {spec.row_end}) of {spec.num_rows}"
            )
    if values is None:
        return
    if values.dtype != np.dtype(spec.dtype):
        raise InvalidRequestError(
            f"{where} has dtype {spec.dtype}, {what} sent rows of {values.dtype}"
        )
    if values.shape != (len(ids), spec.dim):
        raise InvalidRequestError(
            f"{where}: {what} sent {len(ids)} ids but rows of shape {values.shape}; expected "
            f"({len(ids)}, {spec.dim})"
        )
    if values.dtype.kind == "f" and not all_finite(values):
        bad_row = int(np.argmax(~np.isfinite(values).all(axis=1)))
        raise InvalidRequestError(
            f"{where}: {what} has non-finite values (NaN or Inf) in the row of id "
            f"{int(ids[bad_row])}"
        )


@dataclass(frozen=True)
class RowSparse:
    """A row-sparse gradient: ``values[i]`` is the gradient of row ``ids[i]``; repeated ids
    are summed."""

    ids: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        """Raises:
        InvalidRequestError: ids that are not integers (a float id would be truncated).
        """
        ids = np.asarray(self.ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise InvalidRequestError(
                f"RowSparse row ids must be integers, got {ids.dtype} (e.g. {ids.flat[0]!r})"
            )
        object.__setattr__(self, "ids", ids.astype(np.int64, copy=False).reshape(-1))
        object.__setattr__(self, "values", np.asarray(self.values))

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.values.nbytes)


def as_ids(table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """Row ids as a flat int64 array.

    Raises:
        InvalidRequestError: ids that are not integers.
    """
    array = np.asarray(ids)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidRequestError(f"table '{table}': row ids must be integers, got {array.dtype}")
    return array.astype(np.int64, copy=False).reshape(-1)


# -- seeded rows and hashing ----------------------------------------------------------------


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays: a fixed, well-mixed hash of each value."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def init_rows(
    ids: np.ndarray,
    dim: int,
    dtype: str,
    init: str,
    scale: float,
    seed: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The initial values of rows ``ids`` (a (len(ids), dim) array, ``out`` if given): a pure
    function of ``(seed, id)``, so every process that asks gets the same row.

    A row's columns come in pairs, column ``j`` with column ``j + ceil(dim / 2)``: each pair is
    drawn from one 64-bit hash, murmur3's finaliser of (the row's splitmix64 hash xor the
    pair's constant), whose bits 40-63 and 8-31 are two uniforms in [0, 1). "uniform" maps each
    to [-scale, scale); "normal" takes the pair as Box-Muller's radius and angle, cosine to
    the first column and sine to the second (two independent normals). Computed in place in
    cache-sized blocks: 0.47-0.62 us of CPU a row of 64, against 2.0-2.3 when every element
    took its own hash and only the cosine (bench/NOTES.md 26).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty((len(ids), dim), dtype=dtype)
    if init == "zeros" or scale == 0:
        out.fill(0)
        return out
    half = (dim + 1) // 2  # pairs: columns [0, half) and [half, dim)
    block = max(1, _INIT_BLOCK_PAIRS // half)
    pairs = splitmix64(np.arange(half, dtype=np.uint64) + np.uint64(0x632BE59BD9B4E019))
    seed_mix = splitmix64(np.array([seed], dtype=np.uint64))[0]
    size = min(block, len(ids))
    bits_buf, tmp_buf = np.empty((2, size, half), dtype=np.uint64)
    first_buf, second_buf, cos_buf = np.empty((3, size, half), dtype=np.float32)
    narrow_buf = np.empty((size, half), dtype=np.uint32)
    with np.errstate(over="ignore"):
        hashed = splitmix64(ids.view(np.uint64) ^ seed_mix)
        for start in range(0, len(ids), block):
            rows = hashed[start : start + block]
            n = len(rows)
            bits, tmp, narrow = bits_buf[:n], tmp_buf[:n], narrow_buf[:n]
            first, second, trig = first_buf[:n], second_buf[:n], cos_buf[:n]
            np.bitwise_xor(rows[:, None], pairs[None, :], out=bits)
            for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0):
                np.right_shift(bits, np.uint64(33), out=tmp)
                np.bitwise_xor(bits, tmp, out=bits)
                if multiplier:
                    np.multiply(bits, np.uint64(multiplier), out=bits)
            # Two 24-bit uniforms per pair (exact in float32), [0, 1) each: bits 40-63, 8-31.
            np.right_shift(bits, np.uint64(40), out=tmp)
            np.copyto(narrow, tmp, casting="unsafe")
            np.multiply(narrow, np.float32(2.0**-24), out=first, dtype=np.float32)
            np.copyto(narrow, bits, casting="unsafe")  # the low 32 bits
            np.right_shift(narrow, np.uint32(8), out=narrow)
            np.multiply(narrow, np.float32(2.0**-24), out=second, dtype=np.float32)
            target = out[start : start + block]
            low, high = target[:, :half], target[:, half:]
            rest = high.shape[1]  # half, or one less for an odd dim
            if init == "uniform":
                for u, place in ((first, low), (second[:, :rest], high)):
                    u *= np.float32(2.0)
                    u -= np.float32(1.0)
                    np.multiply(u, np.float32(scale), out=place, casting="unsafe")
                continue
            np.negative(first, out=first)
            np.log1p(first, out=first)  # log(1 - u): finite, u < 1
            first *= np.float32(-2.0)
            np.sqrt(first, out=first)  # the radius
            if scale != 1:
                first *= np.float32(scale)
            second *= np.float32(2.0 * np.pi)  # the angle
            np.cos(second, out=trig)
            np.multiply(first, trig, out=low, casting="unsafe")
            np.sin(second[:, :rest], out=trig[:, :rest])
            np.multiply(first[:, :rest], trig[:, :rest], out=high, casting="unsafe")
    return out


def row_items(array: np.ndarray) -> np.ndarray:
    """A C-contiguous 2-d array (of at least one column) as a 1-d array of one item per row,
    a view: ``take`` and assignment by row then move each row as one block of bytes, a third
    faster than element by element for rows of 64 float32."""
    return array.view(np.dtype((np.void, array.shape[1] * array.itemsize))).reshape(-1)


def _by_rows(array: np.ndarray) -> bool:
    return array.ndim == 2 and array.flags.c_contiguous and array.shape[1] > 0


def gather_rows(source: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``source[rows]`` (a new array) for in-range ``rows`` of a 2-d array, each row moved as
    one block of bytes (4,096 random rows of 64 float32: 99 us against ``np.take``'s 118)."""
    if _by_rows(source):
        picked = row_items(source)[rows]
        return picked.view(source.dtype).reshape(len(rows), source.shape[1])
    return np.take(source, rows, axis=0, mode="clip")


def scatter_rows(target: np.ndarray, rows: np.ndarray, source: np.ndarray) -> None:
    """``target[rows] = source`` for distinct ``rows`` of a 2-d array, each row moved as one
    block of bytes."""
    same = source.dtype == target.dtype and source.shape[1:] == target.shape[1:]
    if same and _by_rows(target) and _by_rows(source):
        row_items(target)[rows] = row_items(source)
    else:
        target[rows] = source


def sum_duplicates(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids, their summed rows): sorted, duplicates added in the order given, when any
    id repeats; ``ids`` and ``values`` themselves (no copy) when none does."""
    if len(ids) < 2 or (ids[1:] > ids[:-1]).all():  # e.g. np.unique's, as Embedding sends
        return ids, values
    ordered = np.sort(ids)  # 10x faster than a stable argsort: most pushes repeat no id
    if (ordered[1:] != ordered[:-1]).all():
        return ids, values
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    return sorted_ids[starts], np.add.reduceat(values[order], starts, axis=0)
