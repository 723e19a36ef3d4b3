"""The peer for embedding tables: a torch.distributed.rpc server holding the table's rows,
``index_select`` for a pull and ``index_add_`` for an SGD push (what a PyTorch user would write).

One trainer process (rank 0) and one process per table shard, each holding a contiguous range
of rows (the split ``psworker.placement.TableLayout`` makes for a fixed table). A step pulls the
rows of a batch of ids and pushes their gradient, each shard asked at once (``rpc_async``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bench.torchps import (
    SPAWN,
    START_TIMEOUT_S,
    STEP_TIMEOUT_S,
    TCP,
    _options,
    _quiet,
    free_port,
)

# How the trainer talks to a shard: two RPCs per step (a pull, then a push), or one fused RPC
# that pushes this batch's gradient and returns the next batch's rows.
SEPARATE = "pull + push"
FUSED = "fused"

# This PS process's rows (ids [_START, _START + len)); filled by _emb_init over RPC.
_TABLE: list[Any] = []
_START: list[int] = [0]


@dataclass(frozen=True)
class Spec:
    """The table (``rows`` x ``dim`` float32, U(-0.01, 0.01)), SGD's ``lr``, and the step."""

    rows: int
    dim: int
    lr: float
    grad: float  # every gradient element (as ours)
    reps: int  # steps per timed call
    shards: int
    transport: str
    calls: str = SEPARATE


def _emb_init(rows: int, dim: int, start: int, seed: int) -> int:
    import torch

    gen = torch.Generator().manual_seed(seed)
    _TABLE[:] = [torch.empty(rows, dim).uniform_(-0.01, 0.01, generator=gen)]
    _START[0] = start
    return rows


def _emb_pull(ids: Any) -> Any:
    return _TABLE[0].index_select(0, ids - _START[0])


def _emb_push(ids: Any, grad: Any, lr: float) -> bool:
    _TABLE[0].index_add_(0, ids - _START[0], grad, alpha=-lr)
    return True


def _emb_push_pull(ids: Any, grad: Any, lr: float, next_ids: Any) -> Any:
    _TABLE[0].index_add_(0, ids - _START[0], grad, alpha=-lr)
    return _TABLE[0].index_select(0, next_ids - _START[0])


def _ps_main(rank: int, world: int, transport: str, port: int) -> None:
    """Child process: table shard ``rank`` serves RPCs until the trainer shuts the group down."""
    from torch.distributed import rpc

    _quiet()
    rpc.init_rpc(
        f"ps{rank}", rank=rank, world_size=world, rpc_backend_options=_options(transport, port)
    )
    rpc.shutdown()


def _trainer_main(conn: Connection, spec: Spec, port: int, batches: list[np.ndarray]) -> None:
    """Child process (rank 0): each request runs ``spec.reps`` steps; answers (pull s, push s)
    per step, or (0, fused s) for fused calls."""
    import torch
    from torch.distributed import rpc

    _quiet()
    world = spec.shards + 1
    options = _options(spec.transport, port)
    rpc.init_rpc("trainer", rank=0, world_size=world, rpc_backend_options=options)
    try:
        n = spec.shards
        bounds = np.linspace(0, spec.rows, n + 1).round().astype(np.int64)
        for i in range(n):
            rows = int(bounds[i + 1] - bounds[i])
            rpc.rpc_sync(f"ps{i + 1}", _emb_init, args=(rows, spec.dim, int(bounds[i]), i))
        ids = [torch.from_numpy(b.astype(np.int64)) for b in batches]
        grad = [torch.full((len(b), spec.dim), spec.grad) for b in batches]
        cut = torch.from_numpy(bounds[1:-1])

        def split(t: int) -> list[tuple[int, Any]]:
            """(shard, positions of batch ``t``'s ids it holds; None: all of them)."""
            if n == 1:
                return [(0, None)]
            owner = torch.bucketize(ids[t], cut, right=True)
            return [(s, (owner == s).nonzero().squeeze(1)) for s in range(n)]

        def part(x: Any, pos: Any) -> Any:
            return x if pos is None else x[pos]

        def place(rows: Any, pos: Any, got: Any) -> Any:
            if pos is None:
                return got
            rows[pos] = got
            return rows

        conn.send(True)
        turn = 0
        while conn.recv():
            out = []
            for _ in range(spec.reps):
                t, nxt = turn % len(ids), (turn + 1) % len(ids)
                turn += 1
                t0 = time.perf_counter()
                if spec.calls == FUSED:
                    mine, theirs = split(t), split(nxt)
                    futs = [
                        rpc.rpc_async(
                            f"ps{s + 1}",
                            _emb_push_pull,
                            args=(part(ids[t], p), part(grad[t], p), spec.lr, part(ids[nxt], q)),
                        )
                        for (s, p), (_, q) in zip(mine, theirs, strict=True)
                    ]
                    rows = torch.empty(len(ids[nxt]), spec.dim) if n > 1 else None
                    for (_, q), f in zip(theirs, futs, strict=True):
                        rows = place(rows, q, f.wait())
                    out.append((0.0, time.perf_counter() - t0))
                    continue
                mine = split(t)
                futs = [
                    rpc.rpc_async(f"ps{s + 1}", _emb_pull, args=(part(ids[t], p),)) for s, p in mine
                ]
                rows = torch.empty(len(ids[t]), spec.dim) if n > 1 else None
                for (_, p), f in zip(mine, futs, strict=True):
                    rows = place(rows, p, f.wait())
                t1 = time.perf_counter()
                done = [
                    rpc.rpc_async(
                        f"ps{s + 1}",
                        _emb_push,
                        args=(part(ids[t], p), part(grad[t], p), spec.lr),
                    )
                    for s, p in mine
                ]
                for f in done:
                    f.wait()
                out.append((t1 - t0, time.perf_counter() - t1))
                if rows is None or rows.shape != (len(ids[t]), spec.dim):
                    raise RuntimeError("torch RPC pull returned the wrong rows")
            conn.send(out)
    finally:
        rpc.shutdown()


@contextlib.contextmanager
def embedding_server(spec: Spec, batches: list[np.ndarray]) -> Iterator[Any]:
    """The trainer and ``spec.shards`` table processes; yields ``step()``, which runs
    ``spec.reps`` steps and returns their (pull s, push s) pairs, timed in the trainer.

    Raises:
        RuntimeError: a process died or did not answer in time.
    """
    port = free_port()
    world = spec.shards + 1
    parent, child = SPAWN.Pipe()
    procs = [SPAWN.Process(target=_trainer_main, args=(child, spec, port, batches))]
    procs += [
        SPAWN.Process(target=_ps_main, args=(rank, world, spec.transport, port))
        for rank in range(1, world)
    ]
    for p in procs:
        p.daemon = True
        p.start()
    child.close()
    label = f"torch RPC embedding server ({spec.transport}, {spec.calls})"

    def receive(timeout: float) -> Any:
        if not parent.poll(timeout):
            raise RuntimeError(f"{label} answered nothing in {timeout}s")
        try:
            return parent.recv()
        except EOFError:
            raise RuntimeError(f"{label} died, exit code {procs[0].exitcode}") from None

    # TensorPipe's default transport (shm) busy-polls: idle, its processes burn 1.2-1.9 of
    # this machine's 2 cores (measured), which would slow whatever runs beside them. So they
    # are stopped between their own rounds (SIGSTOP) and continued for them.
    pause = spec.transport != TCP

    def signal_all(sig: int) -> None:
        if pause:
            for p in procs:
                if p.pid is not None and p.is_alive():
                    os.kill(p.pid, sig)

    def step() -> list[tuple[float, float]]:
        signal_all(signal.SIGCONT)
        try:
            parent.send(True)
            return list(receive(STEP_TIMEOUT_S))
        finally:
            signal_all(signal.SIGSTOP)

    try:
        receive(START_TIMEOUT_S)
        signal_all(signal.SIGSTOP)
        yield step
    finally:
        signal_all(signal.SIGCONT)
        with contextlib.suppress(OSError):
            parent.send(False)
        deadline = time.monotonic() + 20.0
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        parent.close()
