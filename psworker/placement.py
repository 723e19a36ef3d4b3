"""Placement: which shard holds which variable (or dim-0 slice of a large one), and which
shard holds each row of an embedding table."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pscore.tables import Table, TableSlice, dynamic_home
from pswire.errors import InvalidRequestError, ModelMismatchError, not_in_model
from pswire.piecekey import check_names, piece_key

# Variables above this many bytes are split along dim 0 across shards (like TF's
# MinSizePartitioner), so one huge embedding does not sit on a single shard.
DEFAULT_SPLIT_BYTES = 8 << 20
# ``part_bytes``: variables above it are also cut into parts of about that size, as BytePS
# partitions tensors: a shard answers a streamed push (``overlap=True``) part by part, so the
# weights of the last gradients backward makes come back one part's trip after them, not one
# whole tensor's. Off by default (0): 1 MiB parts made overlapped steps 1.05-1.07x faster at
# 1 Gbit/s but 0.91-0.94x at 10 Gbit/s in async here, each part costing its own work on a
# CPU-bound shard (bench/NOTES.md entry 43).
DEFAULT_PART_BYTES = 0
# The most parts ``part_bytes`` cuts one variable into: each part costs a key's work on both
# sides every step.
MAX_PARTS = 64


@dataclass(frozen=True)
class VarInfo:
    """A model variable as the partitioner sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        # A torch.Size, a list or numpy ints would otherwise print differently in digest().
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Piece:
    """One stored unit: a whole variable or rows [start, stop) of it, living on one shard."""

    key: str  # name on the shard: the variable's name, or "name/part{i}of{k}"
    var: str
    shard: int
    start: int
    stop: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ShardMap:
    """The placement of a model on ``num_shards`` shards; identical on every process."""

    num_shards: int
    variables: tuple[VarInfo, ...]
    pieces: tuple[Piece, ...]

    @functools.cached_property
    def _by_var(self) -> dict[str, list[Piece]]:
        # Looked up per variable on every push and pull: a scan of all pieces each time made
        # a step O(variables x pieces).
        by_var: dict[str, list[Piece]] = {}
        for p in self.pieces:
            by_var.setdefault(p.var, []).append(p)
        return by_var

    @functools.cached_property
    def _by_key(self) -> dict[str, Piece]:
        return {p.key: p for p in self.pieces}

    @functools.cached_property
    def infos(self) -> dict[str, VarInfo]:
        """The variables by name (computed once: the map never changes)."""
        return {v.name: v for v in self.variables}

    def pieces_of(self, var: str) -> list[Piece]:
        return list(self._by_var.get(var, ()))

    @functools.cached_property
    def keys_by_shard(self) -> tuple[tuple[str, ...], ...]:
        """Every shard's piece keys, in model order (computed once: a step reads them all)."""
        keys: list[list[str]] = [[] for _ in range(self.num_shards)]
        for v in self.variables:
            for p in self._by_var.get(v.name, ()):
                keys[p.shard].append(p.key)
        return tuple(tuple(k) for k in keys)

    def on_shard(self, shard: int) -> list[Piece]:
        return [p for p in self.pieces if p.shard == shard]

    @functools.cached_property
    def _totals(self) -> tuple[int, ...]:
        totals = [0] * self.num_shards
        for p in self.pieces:
            totals[p.shard] += p.nbytes
        return tuple(totals)

    def shard_bytes(self) -> list[int]:
        """Bytes each shard holds (computed once: the map never changes)."""
        return list(self._totals)

    def digest(self) -> str:
        """Digest of the model's (name, shape, dtype) list: equal models, equal digests."""
        # JSON, not "name:dtype:shape" joined by ";": names may hold any separator.
        text = json.dumps([[v.name, str(v.dtype), list(v.shape)] for v in self.variables])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def merge(self, replies: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Every shard's reply (``replies[shard]``: pieces by key) in one dict by piece key.

        Raises:
            ModelMismatchError: a shard replied with a key this map does not place on it, or
                with a key another shard's reply holds too (nothing is merged over another).
        """
        merged: dict[str, np.ndarray] = {}
        by_key = self._by_key
        for shard, reply in enumerate(replies):
            for key, array in reply.items():
                piece = by_key.get(key)
                if piece is None or piece.shard != shard or key in merged:
                    where = "no shard" if piece is None else f"shard {piece.shard}"
                    raise ModelMismatchError(
                        f"shard {shard} replied with '{key}', which this worker's plan places "
                        f"on {where}: the shards hold another model's plan"
                    )
                merged[key] = array
        return merged

    def split(self, arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Cuts full arrays into per-shard pieces (views, no copy): one dict per shard."""
        out: list[dict[str, np.ndarray]] = [{} for _ in range(self.num_shards)]
        by_var = self._by_var
        for name, array in arrays.items():
            parts = by_var.get(name)
            if parts is None:
                raise not_in_model(name, by_var)
            for p in parts:
                out[p.shard][p.key] = array if len(parts) == 1 else array[p.start : p.stop]
        return out

    def destinations(
        self, names: Sequence[str], out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Where each piece of ``names`` should be decoded, by piece key: into ``out[name]``
        (rows of it for a split variable) where given; else, for a split variable, views into
        one new array of its full shape. ``join`` then has nothing left to copy."""
        out = out or {}
        into: dict[str, np.ndarray] = {}
        by_var = self._by_var
        for name in names:
            parts = by_var.get(name, [])
            whole = out.get(name)
            if whole is None and len(parts) > 1:
                info = self.infos[name]
                whole = np.empty(info.shape, dtype=info.dtype)
            if whole is not None:
                into.update({p.key: _rows(whole, p, len(parts)) for p in parts})
        return into

    def check_out(self, out: Mapping[str, np.ndarray] | None, names: Sequence[str]) -> None:
        """``check_out`` against this model's variables among ``names``."""
        if out:
            wanted = set(names)
            check_out(out, {v.name: (v.shape, v.dtype) for v in self.variables if v.name in wanted})

    def join(
        self,
        pieces: Mapping[str, np.ndarray],
        names: Sequence[str],
        into: Mapping[str, np.ndarray] | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Reassembles full variables from pieces keyed by piece key; a split variable whose
        pieces were decoded into ``destinations`` views is returned without a copy. A name in
        ``out`` comes back as ``out[name]``, holding its pieces (copied in if they were
        decoded elsewhere).

        Raises:
            UnknownVariableError: a name is not in the model.
        """
        into = into or {}
        out = out or {}
        result: dict[str, np.ndarray] = {}
        by_var = self._by_var
        for name in names:
            parts = by_var.get(name)
            if not parts:
                raise not_in_model(name, by_var)
            target = out.get(name)
            if target is not None:
                for p in parts:
                    rows = _rows(target, p, len(parts))
                    if not np.may_share_memory(pieces[p.key], rows):
                        np.copyto(rows, pieces[p.key])
                result[name] = target
                continue
            if len(parts) == 1:
                result[name] = pieces[parts[0].key]
                continue
            views = [into.get(p.key) for p in parts]
            whole = views[0].base if views[0] is not None else None
            if whole is not None and all(
                v is not None and np.may_share_memory(pieces[p.key], v)
                for p, v in zip(parts, views, strict=True)
            ):
                result[name] = whole
            else:
                result[name] = np.concatenate([pieces[p.key] for p in parts], axis=0)
        return result


def cuts(v: VarInfo, num_shards: int, split_bytes: int, part_bytes: int) -> int:
    """How many dim-0 slices ``plan`` cuts ``v`` into."""
    rows = v.shape[0] if v.shape else 0
    if rows < 2:
        return 1
    k = num_shards if v.nbytes > split_bytes else 1
    if part_bytes > 0 and v.nbytes > part_bytes:
        k = max(k, min(MAX_PARTS, -(-v.nbytes // part_bytes)))
    return min(k, rows)


def copy_in(
    pieces: Mapping[str, np.ndarray],
    into: Mapping[str, np.ndarray],
    skip: Collection[str] = (),
) -> None:
    """Copies each of ``pieces`` (by piece key) that was not decoded straight into its
    ``into`` array there (a target that is not C-ordered, as a conv weight in
    ``channels_last``, is decoded elsewhere); keys in ``skip`` are left as they are."""
    for key, array in pieces.items():
        target = into.get(key)
        if target is not None and key not in skip and not np.may_share_memory(target, array):
            np.copyto(target, array)


def check_out(
    out: Mapping[str, np.ndarray] | None, variables: Mapping[str, tuple[tuple[int, ...], str]]
) -> None:
    """Checks arrays offered to receive a pull's variables in place (``out``).

    ``variables``: (shape, dtype) of each variable the pull reads.

    Raises:
        InvalidRequestError: a name the pull does not read, or an array of the wrong shape or
            dtype, or read-only.
    """
    for name, array in (out or {}).items():
        if name not in variables:
            raise InvalidRequestError(f"out['{name}']: this pull does not read '{name}'")
        shape, dtype = variables[name]
        if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
            raise InvalidRequestError(
                f"out['{name}'] is {array.dtype} {array.shape}; the variable is {dtype} {shape}"
            )
        if not array.flags.writeable:
            raise InvalidRequestError(f"out['{name}'] is read-only")


def _rows(whole: np.ndarray, piece: Piece, count: int) -> np.ndarray:
    """The part of a variable's full array that ``piece`` (one of ``count``) holds."""
    return whole if count == 1 else whole[piece.start : piece.stop]


def plan(
    variables: Sequence[VarInfo],
    num_shards: int,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    part_bytes: int = DEFAULT_PART_BYTES,
) -> ShardMap:
    """Places variables on shards, balancing bytes; deterministic for equal inputs.

    A variable with more than one row is cut along dim 0 into near-equal slices
    (``cuts``): one per shard where it is larger than ``split_bytes``, and, where it is
    larger than ``part_bytes`` (0: never), into parts of about that size (at most
    ``MAX_PARTS``); never into more slices than rows. A variable's slices go to distinct shards
    while there are shards it has none on. Everything is assigned largest first to the
    least-loaded shard (ties to the lowest index).

    Raises:
        ValueError: ``num_shards`` < 1, a duplicated variable name, or one that reads as a
            slice's key (``pswire.piecekey``).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    names = [v.name for v in variables]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicated variable names: {dup}")
    check_names(names)
    loads = [0] * num_shards
    placed: list[Piece] = []

    def least_loaded(exclude: set[int]) -> int:
        candidates = [s for s in range(num_shards) if s not in exclude] or list(range(num_shards))
        return min(candidates, key=lambda s: (loads[s], s))

    order = sorted(variables, key=lambda v: (-v.nbytes, v.name))
    for v in order:
        rows = v.shape[0] if v.shape else 0
        k = cuts(v, num_shards, split_bytes, part_bytes)
        if k == 1:
            shard = least_loaded(set())
            placed.append(Piece(v.name, v.name, shard, 0, rows, v.shape, v.dtype))
            loads[shard] += v.nbytes
            continue
        bounds = np.linspace(0, rows, k + 1).round().astype(int)
        used: set[int] = set()
        # Larger slices first (rounding makes them differ by a row): a larger slice placed after
        # a smaller one lands on a fuller shard and can push the spread past the largest piece.
        for i in sorted(range(k), key=lambda i: (-(bounds[i + 1] - bounds[i]), i)):
            start, stop = int(bounds[i]), int(bounds[i + 1])
            shape = (stop - start, *v.shape[1:])
            shard = least_loaded(used)
            used.add(shard)
            piece = Piece(piece_key(v.name, i, k), v.name, shard, start, stop, shape, v.dtype)
            placed.append(piece)
            loads[shard] += piece.nbytes
    # Pieces in model order (then slice order) so every process iterates identically.
    index = {n: i for i, n in enumerate(names)}
    placed.sort(key=lambda p: (index[p.var], p.start))
    keys = [p.key for p in placed]
    if len(set(keys)) != len(keys):  # check_names rules it out; a shard must never see it
        raise ValueError(f"piece keys collide: {sorted({k for k in keys if keys.count(k) > 1})}")
    return ShardMap(num_shards, tuple(variables), tuple(placed))


# -- embedding tables ------------------------------------------------------------------------


@dataclass(frozen=True)
class TableLayout:
    """Where a table's rows live: contiguous id ranges (fixed) or ``splitmix64(id) % shards``
    (dynamic, ``pscore.tables.dynamic_home``). Identical on every process."""

    name: str
    table: Table
    num_shards: int
    bounds: tuple[int, ...] = field(default=())

    @classmethod
    def build(cls, name: str, table: Table, num_shards: int) -> TableLayout:
        bounds: tuple[int, ...] = ()
        if table.num_rows is not None:
            cuts = np.linspace(0, table.num_rows, num_shards + 1).round().astype(np.int64)
            bounds = tuple(int(b) for b in cuts)
        return cls(name, table, num_shards, bounds)

    def slice_for(self, shard: int) -> TableSlice:
        t = self.table
        start, end = (self.bounds[shard], self.bounds[shard + 1]) if self.bounds else (0, 0)
        return TableSlice(
            self.name, t.dim, t.dtype, t.num_rows or 0, start, end, t.capacity, t.init,
            t.init_scale, t.seed, t.init_from,
        )  # fmt: skip

    def check_ids(self, ids: np.ndarray, what: str) -> None:
        """Raises InvalidRequestError naming the table and the first out-of-range id."""
        if self.table.num_rows is None or len(ids) == 0:
            return
        if ids.min() >= 0 and ids.max() < self.table.num_rows:  # two passes, no temporaries
            return
        bad = (ids < 0) | (ids >= self.table.num_rows)
        if bad.any():
            raise InvalidRequestError(
                f"table '{self.name}': {what} has id {int(ids[np.argmax(bad)])}, outside "
                f"[0, {self.table.num_rows}) ({int(bad.sum())} ids out of range)"
            )

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """The shard holding each id (ids already checked)."""
        if self.num_shards == 1:
            return np.zeros(len(ids), dtype=np.int64)
        if self.bounds:
            return np.searchsorted(np.asarray(self.bounds[1:-1]), ids, side="right")
        return dynamic_home(ids, self.num_shards)


def tables_digest(tables: Mapping[str, Table]) -> str:
    """Canonical text of a model's tables, for the model digest."""
    return json.dumps({k: tables[k].describe() for k in sorted(tables)}, sort_keys=True)
