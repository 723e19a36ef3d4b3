"""The peer: a parameter server on torch.distributed.rpc, as in PyTorch's own PS tutorial."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import time
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# fork() after grpc or torch started threads can deadlock the child; spawn starts clean.
SPAWN = multiprocessing.get_context("spawn")
START_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 120.0
LR = 1e-3
DEFAULT = "default"  # TensorPipe picks its transports: shm between local processes, then uv
TCP = "tcp"  # TensorPipe restricted to the uv (TCP) transport and the basic channel
TRANSPORTS = (DEFAULT, TCP)

# This PS process's share of the model; filled by _ps_init over RPC.
_PARAMS: dict[str, Any] = {}


def _ps_init(params: dict[str, Any]) -> int:
    _PARAMS.clear()
    _PARAMS.update(params)
    return sum(p.numel() for p in params.values())


def _ps_update_and_fetch(grads: dict[str, Any]) -> dict[str, Any]:
    """The tutorial's fused call: apply SGD to the pushed gradients, return the new weights."""
    for name, grad in grads.items():
        _PARAMS[name].add_(grad, alpha=-LR)
    return _PARAMS


def free_port() -> int:
    """A loopback port free a moment ago (TensorPipe's TCP store cannot report one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _options(transport: str, port: int) -> Any:
    from torch.distributed import rpc

    extra: dict[str, Any] = {}
    if transport == TCP:
        # Private knobs, the documented way to pin TensorPipe (torch 2.x): uv is its TCP
        # transport, basic the channel that sends tensors through it (no shm, no cma).
        extra = {"_transports": ["uv"], "_channels": ["basic"]}
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8,
        rpc_timeout=STEP_TIMEOUT_S,
        init_method=f"tcp://127.0.0.1:{port}",
        **extra,
    )


def _quiet() -> None:
    # rpc.shutdown's internal gloo barrier warns of a deprecated ProcessGroup use, every run.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")


def _ps_main(rank: int, world: int, transport: str, port: int) -> None:
    """Child process: PS ``rank`` serves RPCs until the trainer shuts the group down."""
    from torch.distributed import rpc

    _quiet()
    rpc.init_rpc(
        f"ps{rank}", rank=rank, world_size=world, rpc_backend_options=_options(transport, port)
    )
    rpc.shutdown()  # waits for every process, so this serves until the trainer is done


def _trainer_main(
    conn: Connection, world: int, transport: str, port: int, shapes: dict[str, tuple[int, ...]]
) -> None:
    """Child process (rank 0): pushes gradients and takes weights back, one step per request.

    Each variable is split by rows over the PS processes; a step calls every PS at once and
    concatenates the weights it gets back, as a worker needs whole tensors.
    """
    import torch
    from torch.distributed import rpc

    _quiet()
    rpc.init_rpc("trainer", rank=0, world_size=world, rpc_backend_options=_options(transport, port))
    try:
        n = world - 1
        gen = torch.Generator().manual_seed(0)
        model = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        grads = {k: torch.full(s, 1e-4) for k, s in shapes.items()}

        def split(tensors: dict[str, Any]) -> list[dict[str, Any]]:
            parts = {
                k: torch.tensor_split(v, n) if v.dim() else [v] * n for k, v in tensors.items()
            }
            # tensor_split gives views; clone so RPC sends only each part's bytes.
            return [{k: p[i].clone() for k, p in parts.items()} for i in range(n)]

        for i, part in enumerate(split(model)):
            rpc.rpc_sync(f"ps{i + 1}", _ps_init, args=(part,))
        grad_parts = split(grads)
        nbytes = sum(v.numel() * 4 for v in model.values())
        conn.send(nbytes)
        while conn.recv():
            t0 = time.perf_counter()
            futs = [
                rpc.rpc_async(f"ps{i + 1}", _ps_update_and_fetch, args=(grad_parts[i],))
                for i in range(n)
            ]
            got = [f.wait() for f in futs]
            weights = got[0] if n == 1 else {k: torch.cat([g[k] for g in got]) for k in shapes}
            elapsed = time.perf_counter() - t0
            if sum(w.numel() * 4 for w in weights.values()) != nbytes:
                raise RuntimeError("torch RPC PS returned the wrong number of bytes")
            conn.send(elapsed)
    finally:
        rpc.shutdown()


@contextlib.contextmanager
def torch_ps(shapes: dict[str, tuple[int, ...]], shards: int, transport: str) -> Iterator[Any]:
    """A trainer and ``shards`` PS processes; yields a step callable returning its own seconds.

    Raises:
        RuntimeError: a process died or did not start within START_TIMEOUT_S.
    """
    port = free_port()
    world = shards + 1
    parent, child = SPAWN.Pipe()
    procs = [SPAWN.Process(target=_trainer_main, args=(child, world, transport, port, shapes))]
    procs += [
        SPAWN.Process(target=_ps_main, args=(rank, world, transport, port))
        for rank in range(1, world)
    ]
    for p in procs:
        p.daemon = True
        p.start()
    child.close()

    def receive(timeout: float) -> Any:
        if not parent.poll(timeout):
            raise RuntimeError(f"torch RPC trainer ({transport}) answered nothing in {timeout}s")
        try:
            return parent.recv()
        except EOFError:
            raise RuntimeError(
                f"torch RPC trainer ({transport}) died, exit code {procs[0].exitcode}"
            ) from None

    def step() -> float:
        parent.send(True)
        return float(receive(STEP_TIMEOUT_S))

    try:
        receive(START_TIMEOUT_S)
        yield step
    finally:
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


def model_arrays(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Random float32 variables of ``shapes`` (the same model ours is given)."""
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}
