"""``psctl status`` output: the cluster's shards and workers as tables, or as JSON for scripts."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pscore.job import digest_parts
from pswire.errors import PSError
from pswire.proto import ps_pb2
from pswire.security import ClientSecurity
from psworker.link import shard_status

UNREACHABLE = "UNREACHABLE"
# Past this many variables the table says how many more there are; --json lists them all.
MAX_VARIABLE_ROWS = 20
# The table shows this many of the newest membership changes; --json shows all the shard kept.
MAX_HISTORY_ROWS = 20

# What one shard answered: its status, or why there is none.
Status = ps_pb2.StatusResponse | str
# A DiLoCo job's settings as its workers declare them after the model digest
# (``DiLoCoSettings.variant`` in psworker/diloco.py; tests/unit/test_status_view.py parses
# what that writes, so the two cannot drift apart).
_DILOCO = re.compile(
    r"diloco\(local_steps=(\d+), outer_sync=(True|False)(, dynamic_local_steps=True)?"
    r"(?:, fragments=(\d+))?"
)


def local_steps_of(model_digest: str) -> dict[str, Any] | None:
    """A DiLoCo job's local-step settings from the model digest a shard's Status carries:
    ``{"local_steps": H, "outer_sync": bool, "dynamic_local_steps": bool, "fragments": P,
    "between": what the inner steps between two outer steps are, in words}``; None for a job
    without local steps (its shard's clock then counts the job's own steps). With P
    fragments (Streaming DiLoCo) an outer step exchanges one of them every H/P inner steps."""
    variant = digest_parts(model_digest)[2]
    found = _DILOCO.match(variant)
    if found is None:
        return None
    h, dynamic, fragments = (
        int(found.group(1)),
        found.group(3) is not None,
        int(found.group(4) or 1),
    )
    if dynamic:
        between = f"up to H={h} inner steps (each worker's share of H set by its pace)"
    elif fragments > 1:
        between = (
            f"H/P={h // fragments} inner steps (each exchanging one of P={fragments} fragments)"
        )
    else:
        between = f"H={h} inner steps"
    return {
        "local_steps": h,
        "outer_sync": found.group(2) == "True",
        "dynamic_local_steps": dynamic,
        "fragments": fragments,
        "between": between,
    }


def gather(
    addresses: Sequence[str], timeout: float = 5.0, security: ClientSecurity | None = None
) -> tuple[list[str], list[Status]]:
    """Each shard's grpc.health.v1 status name and its Status reply (or the error's text).

    ``security`` defaults to ``$PS_TLS_*`` / ``$PS_TOKEN``, as ``psworker.connect`` does.

    Raises:
        ValueError: bad TLS or token settings.
    """
    security = security or ClientSecurity.from_env()
    health: list[str] = []
    statuses: list[Status] = []
    for address in addresses:
        name, problem = _health(address, timeout, security)
        health.append(name)
        if problem is not None:
            statuses.append(problem)
            continue
        try:
            statuses.append(shard_status([address], timeout, security)[0])
        except PSError as exc:
            statuses.append(str(exc))
    return health, statuses


def _health(address: str, timeout: float, security: ClientSecurity) -> tuple[str, str | None]:
    """The shard's health status name, and why it has none (None when it answered)."""
    with security.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return UNREACHABLE, f"no answer within {timeout:g}s"
            hint = security.diagnose(address, exc.details() or "")
            why = f"unreachable ({exc.code().name}): {exc.details()}"
            return UNREACHABLE, why + (f". Likely cause: {hint}" if hint else "")
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)), None


def all_serving(health: Sequence[str], statuses: Sequence[Status]) -> bool:
    """Whether every shard is SERVING and answered Status (``psctl status`` exits 0)."""
    return all(h == "SERVING" for h in health) and not any(isinstance(s, str) for s in statuses)


def to_data(
    addresses: Sequence[str], statuses: Sequence[Status], health: Sequence[str] | None = None
) -> dict[str, Any]:
    """The cluster as plain data: ``{"shards": [...], "workers": [...]}``.

    Each shard has its address, health, job (mode, ``staleness``: the ssp bound, ``elastic``:
    its min and max workers or None, ``diloco``: a DiLoCo job's ``local_steps``,
    ``outer_sync`` and ``dynamic_local_steps``, or None), clock (and ``clock_counts``:
    "steps" in sync, "pushes applied" in async and ssp; in DiLoCo "outer steps" and "outer
    steps applied (one per push)"),
    variables, embedding tables (rows, bytes, evictions), bytes, push counts,
    ``max_staleness`` (clock spread of the live workers), workers (clock, staleness, live,
    seconds since heard), ``membership`` (joins, leaves, drops, joins pending, and the history
    of changes, oldest first) and newest checkpoint, or ``error``.
    The workers list merges the shards' views of each worker.
    """
    health = list(health) if health is not None else ["UNKNOWN"] * len(addresses)
    shards = [
        _shard_data(i, a, h, s)
        for i, (a, h, s) in enumerate(zip(addresses, health, statuses, strict=True))
    ]
    return {"shards": shards, "workers": _merge_workers(shards)}


def _shard_data(index: int, address: str, health: str, status: Status) -> dict[str, Any]:
    data: dict[str, Any] = {"shard": index, "address": address, "health": health}
    if isinstance(status, str):
        data["error"] = status
        return data
    job = status.job if status.HasField("job") else None
    dense = [v for v in (job.variables if job else []) if not v.HasField("table")]
    specs = {v.name: v for v in (job.variables if job else []) if v.HasField("table")}
    clocks = {w.worker_id: int(w.clock) for w in status.workers}
    newest = max(clocks.values(), default=0)
    live = set(status.live_workers)
    left = set(status.left_workers)
    diloco = local_steps_of(job.model_digest) if job else None
    data.update(
        error=None,
        initialized=status.initialized,
        incarnation=status.incarnation,
        data_port=status.data_port or None,  # the Arrow Flight port for tensors; None: none
        mode=job.mode if job else None,
        staleness=job.staleness if job else None,  # the ssp bound the job declared
        num_workers=job.num_workers if job else None,
        elastic=(
            {"min_workers": job.min_workers, "max_workers": job.max_workers}
            if job and job.max_workers
            else None
        ),
        membership={
            "joins": int(status.joins),
            "leaves": int(status.leaves),
            "drops": int(status.drops),
            "pending": sorted(status.pending_workers),
            "history": [
                {
                    "step": int(e.step),
                    "worker_id": e.worker_id,
                    "kind": e.kind,
                    "seconds_ago": round(e.seconds_ago, 3),
                    "members": list(e.members),
                }
                for e in status.history
            ],
        },
        optimizer=(
            {"name": job.optimizer.name, **dict(sorted(job.optimizer.params.items()))}
            if job
            else None
        ),
        clock=int(status.clock),
        diloco=diloco,
        clock_counts=_clock_counts(job.mode, diloco) if job else None,
        num_variables=len(dense),
        variables=[
            {"name": v.name, "dtype": v.dtype, "shape": [int(d) for d in v.shape]} for v in dense
        ],
        tables=[_table_data(t, specs.get(t.name)) for t in status.tables],
        total_bytes=int(status.total_bytes),
        pushes_applied=int(status.pushes_applied),
        pushes_duplicate=int(status.pushes_duplicate),
        pushes_late=int(status.pushes_late),
        live_workers=sorted(live),
        left_workers=sorted(left),
        failure=status.failure or None,
        max_staleness=(
            max(clocks[w] for w in live if w in clocks)
            - min(clocks[w] for w in live if w in clocks)
            if live & clocks.keys()
            else 0
        ),
        workers=[
            {
                "worker_id": w.worker_id,
                "clock": int(w.clock),
                "staleness": newest - int(w.clock),
                "live": w.worker_id in live,
                "left": w.worker_id in left,
                "seconds_since_heartbeat": round(w.seconds_since_heartbeat, 3),
            }
            for w in sorted(status.workers, key=lambda w: w.worker_id)
        ],
        checkpoint=(
            {"step": int(status.checkpoint_step), "age_s": round(status.checkpoint_age_s, 3)}
            if status.checkpoint_step >= 0
            else None
        ),
    )
    return data


def _clock_counts(mode: str, diloco: dict[str, Any] | None) -> str:
    """What a shard's clock (and its workers' clocks) count: a sync shard's, steps (in DiLoCo
    outer steps); async and ssp apply each push as one update (in DiLoCo each push is one
    worker's outer step)."""
    if diloco is not None:
        return "outer steps" if mode == "sync" else "outer steps applied (one per push)"
    return "steps" if mode == "sync" else "pushes applied"


def _table_data(t: ps_pb2.TableStatus, spec: ps_pb2.VariableSpec | None) -> dict[str, Any]:
    """One shard's part of an embedding table: rows held, bytes (with optimizer state),
    evictions, and which ids it serves ("ids": [start, end) of a fixed table, else None)."""
    table = spec.table if spec is not None else None
    fixed = table is not None and table.num_rows > 0
    return {
        "name": t.name,
        "rows": int(t.rows),
        "bytes": int(t.bytes),
        "evictions": int(t.evictions),
        "capacity": int(t.capacity),
        "dim": int(spec.shape[1]) if spec is not None and len(spec.shape) == 2 else None,
        "num_rows": int(table.num_rows) if fixed and table is not None else None,
        "ids": [int(table.row_start), int(table.row_end)] if fixed and table is not None else None,
    }


def _merge_workers(shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per worker: its clock on each shard (null where a shard does not know it or
    did not answer), worst staleness, live on every shard, and when last heard."""
    merged: dict[int, dict[str, Any]] = {}
    answered = [s for s in shards if not s.get("error")]
    for shard in answered:
        for w in shard["workers"]:
            entry = merged.setdefault(
                w["worker_id"],
                {
                    "worker_id": w["worker_id"],
                    "clocks": [None] * len(shards),
                    "staleness": 0,
                    "live": True,
                    "left": False,
                    "seconds_since_heartbeat": w["seconds_since_heartbeat"],
                },
            )
            entry["clocks"][shard["shard"]] = w["clock"]
            entry["staleness"] = max(entry["staleness"], w["staleness"])
            entry["live"] = entry["live"] and w["live"]
            entry["left"] = entry["left"] or w.get("left", False)
            entry["seconds_since_heartbeat"] = min(
                entry["seconds_since_heartbeat"], w["seconds_since_heartbeat"]
            )
    for entry in merged.values():
        # A shard that never heard of the worker also counts against "live".
        known = sum(entry["clocks"][s["shard"]] is not None for s in answered)
        entry["live"] = entry["live"] and known == len(answered)
    return [merged[w] for w in sorted(merged)]


def render_json(
    addresses: Sequence[str], statuses: Sequence[Status], health: Sequence[str] | None = None
) -> str:
    """``to_data`` as indented JSON."""
    return json.dumps(to_data(addresses, statuses, health), indent=2)


def _data_ports(shards: Sequence[dict[str, Any]]) -> str:
    """The line naming each shard's Flight data port (tensor bytes), or that it has none."""
    ports = [
        f"shard {s['shard']} :{s['data_port']}"
        if s.get("data_port")
        else f"shard {s['shard']} none"
        for s in shards
        if not s.get("error")
    ]
    return "data ports (Arrow Flight, tensor bytes; none: on the gRPC port): " + ", ".join(ports)


def render_table(
    addresses: Sequence[str], statuses: Sequence[Status], health: Sequence[str] | None = None
) -> str:
    """Shards, then workers, then embedding tables, then variables, as aligned text tables.

    Per shard: health, mode, clock, variables, bytes, live workers, the clock spread between
    live workers (staleness), pushes applied/duplicate/late, and the newest checkpoint. Per
    worker: its clock on each shard, how far it is behind the newest worker, whether every
    shard counts it live, and when it was last heard.
    """
    data = to_data(addresses, statuses, health)
    shards, workers = data["shards"], data["workers"]
    rows = []
    for s in shards:
        if s.get("error"):
            rows.append([str(s["shard"]), s["address"], s["health"], *["-"] * 9])
            continue
        rows.append(
            [
                str(s["shard"]),
                s["address"],
                s["health"],
                _mode(s),
                str(s["clock"]),
                str(s["num_variables"]),
                _bytes(s["total_bytes"]),
                _live(s),
                str(s["max_staleness"]),
                f"{s['pushes_applied']}/{s['pushes_duplicate']}",
                str(s["pushes_late"]),
                _checkpoint(s["checkpoint"]),
            ]
        )
    headers = ["SHARD", "ADDRESS", "HEALTH", "MODE", "CLOCK", "VARS", "BYTES", "LIVE"]
    headers += ["STALENESS", "PUSHES/DUP", "LATE", "LAST CHECKPOINT"]
    lines = _table(headers, rows)
    lines += [_data_ports(shards)] if any(not s.get("error") for s in shards) else []
    lines += [
        f"shard {s['shard']} ({s['address']}): {s['error']}" for s in shards if s.get("error")
    ]
    if any(s.get("clock_counts") == "pushes applied" for s in shards):
        lines.append(
            "CLOCK: updates applied; in async and ssp one per push (each worker's own step is "
            "its CLOCK below), in sync one per step"
        )
    diloco = next((s["diloco"] for s in shards if s.get("diloco")), None)
    if diloco is not None:
        lines.append(_diloco_note(diloco))

    answered = [s["shard"] for s in shards if not s.get("error")]
    lines.append("")
    if not workers:
        lines.append("workers: none registered")
    else:
        worker_rows = [
            [
                str(w["worker_id"]),
                " ".join("-" if w["clocks"][i] is None else str(w["clocks"][i]) for i in answered),
                str(w["staleness"]),
                "yes" if w["live"] else ("left" if w["left"] else "dropped"),
                f"{w['seconds_since_heartbeat']:.1f}s ago",
            ]
            for w in workers
        ]
        clock_header = "CLOCK" if len(answered) == 1 else f"CLOCKS (shards {_ids(answered)})"
        lines += _table(["WORKER", clock_header, "STALENESS", "LIVE", "LAST SEEN"], worker_rows)

    table_rows = [
        [
            t["name"],
            str(s["shard"]),
            f"{t['ids'][0]}..{t['ids'][1] - 1} of {t['num_rows']}" if t["ids"] else "hashed",
            str(t["dim"]),
            str(t["rows"]),
            _bytes(t["bytes"]),
            str(t["evictions"]) if t["capacity"] else "-",
            str(t["capacity"]) if t["capacity"] else "-",
        ]
        for s in shards
        if not s.get("error")
        for t in s["tables"]
    ]
    if table_rows:
        lines.append("")
        headers = ["TABLE", "SHARD", "IDS", "DIM", "ROWS", "BYTES", "EVICTIONS", "CAPACITY"]
        lines += _table(headers, table_rows)

    lines += _history(shards)

    variable_rows = [
        [v["name"], str(s["shard"]), "x".join(map(str, v["shape"])) or "scalar", v["dtype"]]
        for s in shards
        if not s.get("error")
        for v in s["variables"]
    ]
    if variable_rows:
        lines.append("")
        shown = variable_rows[:MAX_VARIABLE_ROWS]
        lines += _table(["VARIABLE", "SHARD", "SHAPE", "DTYPE"], shown)
        if len(variable_rows) > len(shown):
            lines.append(f"... and {len(variable_rows) - len(shown)} more (--json lists all)")
    return "\n".join(lines)


def _live(shard: dict[str, Any]) -> str:
    """Live workers of the job's: "2/4", or of an elastic job's bounds: "3 (2..4)"."""
    if shard["elastic"]:
        bounds = shard["elastic"]
        return f"{len(shard['live_workers'])} ({bounds['min_workers']}..{bounds['max_workers']})"
    return f"{len(shard['live_workers'])}/{shard['num_workers'] or 0}"


def _history(shards: list[dict[str, Any]]) -> list[str]:
    """The newest membership changes, as the first shard that answered saw them (every shard
    sees the same joins and leaves; drops for silence may differ by a heartbeat)."""
    answered = [s for s in shards if not s.get("error")]
    if not answered or not answered[0]["membership"]["history"]:
        return []
    first = answered[0]
    m = first["membership"]
    events = m["history"][-MAX_HISTORY_ROWS:]
    rows = [
        [
            str(e["step"]),
            str(e["worker_id"]),
            e["kind"],
            f"{_age(e['seconds_ago'])} ago",
            ",".join(map(str, e["members"])) or "none",
        ]
        for e in events
    ]
    title = (
        f"membership (shard {first['shard']}): {m['joins']} joins, {m['leaves']} leaves, "
        f"{m['drops']} drops" + (f"; joining now: {m['pending']}" if m["pending"] else "")
    )
    lines = ["", title]
    step = "OUTER STEP" if first.get("diloco") else "STEP"
    lines += _table([step, "WORKER", "CHANGE", "WHEN", "MEMBERS AFTER"], rows)
    if len(m["history"]) > len(events):
        lines.append(f"... {len(m['history']) - len(events)} older changes (--json lists them)")
    return lines


def _mode(shard: dict[str, Any]) -> str:
    if not shard["initialized"] and shard["mode"] is None:
        return "(no job)"
    mode = shard["mode"] or "-"
    diloco = shard.get("diloco")
    if diloco is not None:  # the shard runs the outer steps in its sync or async rule
        h = ("H<=" if diloco["dynamic_local_steps"] else "H=") + str(diloco["local_steps"])
        if diloco["fragments"] > 1:
            h += f",P={diloco['fragments']}"
        return f"diloco({h})" if diloco["outer_sync"] else f"diloco({h},async)"
    return f"ssp({shard['staleness']})" if mode == "ssp" else mode


def _diloco_note(diloco: dict[str, Any]) -> str:
    """What the clocks of a DiLoCo job count, under the shards' table."""
    inner = diloco["between"]
    if diloco["outer_sync"]:
        return (
            f"CLOCK: outer steps (DiLoCo: each worker takes {inner} between two); the "
            "workers' CLOCKS and STALENESS below count outer steps too"
        )
    return (
        f"CLOCK: outer steps applied, one per worker's push (DiLoCo, asynchronous: each "
        f"worker takes {inner} between two); the workers' CLOCKS and STALENESS below count "
        "each worker's own outer steps"
    )


def _checkpoint(checkpoint: dict[str, Any] | None) -> str:
    if checkpoint is None:
        return "none"
    return f"step {checkpoint['step']}, {_age(checkpoint['age_s'])} ago"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _ids(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
