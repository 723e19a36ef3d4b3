"""What leaves a worker for the shards: each shard's part of the job, and each push checked
against the model, compressed and cut into each shard's part.

Everything a worker can know is checked here, before any shard hears of the push, so a bad
gradient never reaches some shards and not others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set
from itertools import pairwise

import numpy as np

from pscore.checks import all_finite, all_finite_together, batched, check_tensor
from pscore.job import Job, VarSpec
from pscore.tables import RowSparse, as_ids
from pswire.codec import float32_to_bfloat16
from pswire.errors import InvalidRequestError, ModelMismatchError, not_in_model
from pswire.proto import ps_pb2
from psworker.placement import ShardMap, TableLayout

Pieces = list[dict[str, np.ndarray | RowSparse]]


def split_push(
    grads: Mapping[str, np.ndarray | RowSparse],
    shard_map: ShardMap,
    tables: Mapping[str, TableLayout],
    buffers: Set[str],
    compression: str | None,
) -> Pieces:
    """Each shard's part of a push: dense gradients checked (name, shape, dtype, finite) and
    compressed as asked, cut along the placement; a table's rows checked and sent to the
    shard holding each id.

    Raises:
        UnknownVariableError: a name that is neither a variable nor a table.
        ShapeMismatchError, InvalidRequestError: wrong shape or dtype, non-finite values, bad
            row ids.
    """
    infos = shard_map.infos
    arrays: dict[str, np.ndarray] = {}
    finite = all_finite_together(grads.values())  # many small ones: at once
    for name, grad in grads.items():
        if isinstance(grad, RowSparse):
            continue
        info = infos.get(name)
        if info is None:
            raise not_in_model(name, infos)
        array = np.asarray(grad)
        what = "buffer value" if name in buffers else "gradient"
        check_tensor(name, info.shape, info.dtype, array, what, finite and batched(array))
        arrays[name] = array if name in buffers else compress(array, compression)
    pieces: Pieces = [dict(p) for p in shard_map.split(arrays)]
    for name, grad in grads.items():
        if isinstance(grad, RowSparse):
            layout = tables.get(name)
            if layout is None:
                raise not_in_model(name, tables, "table")
            for shard, part in enumerate(split_rows(layout, grad, compression)):
                pieces[shard][name] = part
    return pieces


def shard_jobs(
    shard_map: ShardMap,
    tables: Mapping[str, TableLayout],
    buffers: Set[str],
    group: Mapping[str, int],
    job: Job,
    job_id: str,
) -> list[Job]:
    """Each shard's part of ``job`` (its variables and table slices, each in its parameter
    group, and its index and the shard count), with ``job_id``."""
    out = []
    for shard in range(shard_map.num_shards):
        variables = [
            VarSpec(p.key, p.shape, p.dtype, p.var in buffers, group=group[p.var])
            for p in shard_map.on_shard(shard)
        ] + [VarSpec.of_table(t.slice_for(shard), group[n]) for n, t in tables.items()]
        out.append(
            dataclasses.replace(
                job,
                variables=tuple(variables),
                job_id=job_id,
                shard=shard,
                num_shards=shard_map.num_shards,
            )
        )
    return out


def check_shards_agree(
    registered: Sequence[ps_pb2.RegisterWorkerResponse], addresses: Sequence[str]
) -> None:
    """Before worker 0 installs its initial values: shards that hold trained values and shards
    that hold none would end as a model mixed from two runs.

    Raises:
        ModelMismatchError: naming which shards hold what.
    """
    trained = [i for i, r in enumerate(registered) if r.initialized and r.clock > 0]
    empty = [i for i, r in enumerate(registered) if not r.initialized]
    if trained and empty:
        held = ", ".join(
            f"shard {i} ({addresses[i]}) job {registered[i].job_id or '?'} at step "
            f"{registered[i].clock}"
            for i in trained
        )
        raise ModelMismatchError(
            f"{held} hold trained values, but shards {empty} hold none: initialising those "
            "would mix two runs in one model. Restore every shard from the same run's "
            "checkpoints, or clear them all to start anew"
        )


def compress(grad: np.ndarray, compression: str | None) -> np.ndarray:
    """float32 gradients in 16 bits on the wire when asked (the shards widen them back)."""
    if compression is None or grad.dtype != np.float32:
        return grad
    if compression == "fp16":
        with np.errstate(over="ignore"):  # overflow -> inf, which the shard refuses by name
            return grad.astype(np.float16)
    return float32_to_bfloat16(grad)


def wire_dtype(dtype: str, compression: str | None) -> str:
    """The dtype a gradient of ``dtype`` travels as (``compress``'s rule)."""
    if compression is None or dtype != "float32":
        return dtype
    return "float16" if compression == "fp16" else "bfloat16"


def wire_nbytes(grad: np.ndarray, compression: str | None) -> int:
    """The bytes ``compress(grad, compression)`` has, without compressing it."""
    if compression is None or grad.dtype != np.float32:
        return int(grad.nbytes)
    return int(grad.size) * 2  # float16 or bfloat16


def split_rows(layout: TableLayout, grad: RowSparse, compression: str | None) -> list[RowSparse]:
    """A table's gradient cut into each shard's rows, none for some: every shard's slice
    takes one optimizer step for it, as torch steps a parameter once for a sparse gradient
    whatever its rows (Adam's bias correction counts the steps of the table, not of rows on
    one shard), so the step is the same on any shard count.

    Raises:
        InvalidRequestError: bad ids, rows of the wrong shape, or non-finite rows.
    """
    table = layout.name
    ids = as_ids(table, grad.ids)
    values = np.asarray(grad.values)
    if values.shape != (len(ids), layout.table.dim):
        raise InvalidRequestError(
            f"table '{table}': push sent {len(ids)} ids with rows of shape {values.shape}; "
            f"expected ({len(ids)}, {layout.table.dim})"
        )
    layout.check_ids(ids, "push")
    if values.dtype.kind == "f" and not all_finite(values):
        raise InvalidRequestError(f"table '{table}': push sent rows with NaN or Inf values")
    values = compress(values, compression)
    if layout.num_shards == 1:
        return [RowSparse(ids, values)]
    if layout.bounds and (ids[1:] >= ids[:-1]).all():  # sorted (as Embedding's): slices
        cuts = [0, *np.searchsorted(ids, np.asarray(layout.bounds[1:-1])).tolist(), len(ids)]
        return [RowSparse(ids[a:b], values[a:b]) for a, b in pairwise(cuts)]
    owner = layout.shard_of(ids)
    parts: list[RowSparse] = []
    for shard in range(layout.num_shards):
        where = np.flatnonzero(owner == shard)
        rows = np.take(values, where, axis=0, mode="clip")  # positions: in range
        parts.append(RowSparse(ids[where], rows))
    return parts
