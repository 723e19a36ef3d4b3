"""A shard's state as a checkpoint file holds it: arrays by name, and a JSON document for the
rest (job, clocks, counters, scalar slots), with the digest that seals both."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from pscore.checks import check_dtype, check_tensor
from pscore.job import Job, VarSpec
from pscore.optspec import optimizer_from_spec
from pscore.rowstore import TableState
from pscore.tables import TableSlice
from psserver.consistency import make_policy
from psserver.records import ShardState

FORMAT = "psgrpc-shard-checkpoint"
VERSION = 1


def digest(text: str, tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the JSON state and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        array = _contiguous(tensors[name])
        h.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
        h.update(array.data)
    return h.hexdigest()


def _contiguous(array: np.ndarray) -> np.ndarray:
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")


def _var_tensor(key: str) -> str:
    return f"var/{key}"


def _slot_tensor(key: str, slot: str) -> str:
    return f"slot/{key}/{slot}"


def _table_tensor(key: str, part: str) -> str:
    return f"table/{key}/{part}"


def _split_slots(key: str, slots: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """(array slots, scalar slots) of one variable's or table's optimizer state.

    Raises:
        ValueError: a slot a checkpoint cannot store.
    """
    arrays, values = {}, {}
    for slot, value in slots.items():
        if isinstance(value, np.ndarray):
            arrays[slot] = _contiguous(value)
        elif value is None or isinstance(value, bool | int | float):
            values[slot] = value
        else:
            raise ValueError(
                f"optimizer slot '{slot}' of '{key}' holds a {type(value).__name__}, which a "
                "checkpoint cannot store"
            )
    return arrays, values


def _encode_tables(
    tables: Mapping[str, TableState], tensors: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Adds each table's rows, ids and slot arrays to ``tensors``; returns the JSON part."""
    doc = {}
    for key, table in tables.items():
        tensors[_table_tensor(key, "values")] = _contiguous(table.values)
        if table.ids is not None:
            tensors[_table_tensor(key, "ids")] = _contiguous(table.ids)
        arrays, values = _split_slots(key, table.slots)
        for slot, array in arrays.items():
            tensors[_table_tensor(key, f"slot/{slot}")] = array
        doc[key] = {"evictions": table.evictions, "slot_arrays": sorted(arrays), "slots": values}
    return doc


def _decode_tables(
    specs: Mapping[str, TableSlice],
    job: Job,
    doc: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    expected: set[str],
) -> dict[str, TableState]:
    """Rebuilds each table's state, adding the tensor names it used to ``expected``.

    Raises:
        ValueError, KeyError: the contents do not describe the job's tables.
    """
    if set(doc) != set(specs):
        raise ValueError(f"checkpoint holds tables {sorted(doc)}, the job has {sorted(specs)}")
    out = {}
    for key, spec in specs.items():
        entry = doc[key]
        names = [_table_tensor(key, "values")]
        if spec.dynamic:
            names.append(_table_tensor(key, "ids"))
        names += [_table_tensor(key, f"slot/{slot}") for slot in entry["slot_arrays"]]
        expected.update(names)
        values = tensors[names[0]]
        ids = tensors[names[1]] if spec.dynamic else None
        if ids is not None and (ids.dtype != np.int64 or ids.shape != (len(values),)):
            raise ValueError(f"table '{key}': ids {ids.dtype} {ids.shape} for {len(values)} rows")
        slots = dict(entry["slots"])
        template = job.optimizer_of(key).make_state(np.zeros((0, spec.dim), dtype=spec.dtype))
        for slot in entry["slot_arrays"]:
            array = tensors[_table_tensor(key, f"slot/{slot}")]
            check_tensor(f"{key}:{slot}", values.shape, spec.dtype, array, "checkpoint")
            slots[slot] = array
        if set(slots) != set(template):
            raise ValueError(
                f"table '{key}' has slots {sorted(slots)}, expected {sorted(template)}"
            )
        out[key] = TableState(ids, values, slots, int(entry["evictions"]))
    return out


def encode_state(state: ShardState, incarnation: str) -> tuple[dict[str, np.ndarray], str]:
    """Splits a state into named arrays and the JSON that describes the rest."""
    tensors: dict[str, np.ndarray] = {}
    for key, value in state.variables.items():
        tensors[_var_tensor(key)] = _contiguous(value)
    slot_arrays: dict[str, list[str]] = {}
    slot_values: dict[str, dict[str, Any]] = {}
    for key, slots in state.slots.items():
        arrays, slot_values[key] = _split_slots(key, slots)
        slot_arrays[key] = list(arrays)
        for slot, array in arrays.items():
            tensors[_slot_tensor(key, slot)] = array
    tables = _encode_tables(state.tables, tensors)
    job = state.job
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "incarnation": incarnation,
        "saved_at": time.time(),
        "job": {
            "mode": job.mode,
            "staleness": job.staleness,
            "num_workers": job.num_workers,
            "quorum": job.quorum,
            "model_digest": job.model_digest,
            "job_id": job.job_id,
            "min_workers": job.min_workers,
            "max_workers": job.max_workers,
            "shard": job.shard,
            "num_shards": job.num_shards,
            "optimizer": {"name": job.optimizer.name, "params": job.optimizer.params()},
            "groups": [{"name": g.name, "params": g.params()} for g in job.groups],
            "variables": [
                {
                    "key": v.key,
                    "shape": list(v.shape),
                    "dtype": v.dtype,
                    "average": v.average,
                    "table": None if v.table is None else asdict(v.table),
                    "group": v.group,
                }
                for v in job.variables
            ],
        },
        "tables": tables,
        "updates": state.updates,
        "finished": {str(w): n for w, n in state.finished.items()},
        "counters": dict(state.counters),
        "members": {str(w): n for w, n in state.members.items()},
        "rosters": [[step, list(members)] for step, members in state.rosters],
        "left": list(state.left),
        "slot_arrays": slot_arrays,
        "slot_values": slot_values,
    }
    return tensors, json.dumps(doc, sort_keys=True, allow_nan=False)


def decode_state(text: str, tensors: Mapping[str, np.ndarray]) -> ShardState:
    """Rebuilds and validates a state; every mismatch raises.

    Raises:
        ValueError, KeyError, TypeError, PSError: the contents do not describe one shard.
    """
    doc = json.loads(text)
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(
            f"format {doc.get('format')!r} version {doc.get('version')!r}; this build reads "
            f"{FORMAT!r} version {VERSION}"
        )
    spec = doc["job"]
    variables = []
    for v in spec["variables"]:
        check_dtype(v["dtype"], v["key"])
        table = TableSlice(**v["table"]) if v.get("table") else None
        shape = tuple(int(d) for d in v["shape"])
        group = int(v.get("group", 0))  # absent before parameter groups
        variables.append(VarSpec(v["key"], shape, v["dtype"], bool(v["average"]), table, group))
    job = Job(
        mode=spec["mode"],
        staleness=int(spec["staleness"]),
        num_workers=int(spec["num_workers"]),
        optimizer=optimizer_from_spec(spec["optimizer"]["name"], spec["optimizer"]["params"]),
        variables=tuple(variables),
        model_digest=spec["model_digest"],
        quorum=int(spec["quorum"]),
        job_id=str(spec.get("job_id", "")),  # checkpoints older than job ids have none
        groups=tuple(optimizer_from_spec(g["name"], g["params"]) for g in spec.get("groups", [])),
        min_workers=int(spec.get("min_workers", 0)),  # absent before elastic jobs
        max_workers=int(spec.get("max_workers", 0)),
        shard=int(spec.get("shard", 0)),  # absent before placements were recorded
        num_shards=int(spec.get("num_shards", 0)),
    )
    job.check(max(job.num_workers, 1), len(job.variables))  # groups, tables, names
    make_policy(job.mode, job.staleness, job.quorum)  # raises on a mode this build lacks
    dense = [v for v in variables if v.table is None]
    expected = {_var_tensor(v.key) for v in dense}
    values = {}
    for v in dense:
        array = tensors[_var_tensor(v.key)]
        check_tensor(v.key, v.shape, v.dtype, array, "checkpoint")
        values[v.key] = array
    slot_arrays, slot_values = doc["slot_arrays"], doc["slot_values"]
    trained = {v.key for v in dense if not v.average}
    if set(slot_arrays) != trained or set(slot_values) != trained:
        raise ValueError(
            f"optimizer state covers {sorted(slot_arrays)}, the trained variables are "
            f"{sorted(trained)}"
        )
    slots: dict[str, dict] = {}
    for key in sorted(trained):
        template = job.optimizer_of(key).make_state(values[key])
        state = {**slot_values[key]}
        for slot in slot_arrays[key]:
            name = _slot_tensor(key, slot)
            expected.add(name)
            state[slot] = tensors[name]
        _check_slots(key, values[key], template, state)
        slots[key] = state
    table_specs = {v.key: v.table for v in variables if v.table is not None}
    tables = _decode_tables(table_specs, job, doc.get("tables", {}), tensors, expected)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ValueError(f"tensors the metadata does not describe: {extra[:10]}")
    return ShardState(
        job=job,
        variables=values,
        slots=slots,
        updates=int(doc["updates"]),
        finished={int(w): int(n) for w, n in doc["finished"].items()},
        counters={str(k): int(n) for k, n in doc["counters"].items()},
        tables=tables,
        saved_at=float(doc["saved_at"]) if "saved_at" in doc else None,
        members={int(w): int(n) for w, n in doc.get("members", {}).items()},
        rosters=[(int(s), tuple(int(w) for w in m)) for s, m in doc.get("rosters", [])],
        left=[int(w) for w in doc.get("left", [])],
    )


def _check_slots(key: str, param: np.ndarray, template: dict, state: dict) -> None:
    """Checks one variable's restored slots against what its optimizer makes.

    Raises:
        ValueError: a slot missing, extra, of the wrong kind or shape.
    """
    if set(state) != set(template):
        raise ValueError(
            f"variable '{key}' has optimizer slots {sorted(state)}, expected {sorted(template)}"
        )
    for slot, fresh in template.items():
        value = state[slot]
        if isinstance(value, np.ndarray):
            # None marks a slot made lazily on the first step (SGD's momentum buffer).
            if not (fresh is None or isinstance(fresh, np.ndarray)):
                raise ValueError(f"slot '{slot}' of '{key}' is an array, expected a number")
            check_tensor(f"{key}:{slot}", param.shape, param.dtype.name, value, "checkpoint")
        elif isinstance(fresh, np.ndarray) or type(value) is not type(fresh):
            raise ValueError(
                f"slot '{slot}' of '{key}' holds {value!r}, expected a {type(fresh).__name__}"
            )
