"""The built data port (psserver/flight_service.py, psworker/flight_link.py) as a bench system.

Each shard is a child process running a ``Shard`` behind both ports: the grpcio control port
(register, init) and the Flight data port. The worker initialises through ``psworker.connect``
and then sends each step's pieces over ``FlightLink``s, one per shard in parallel, decoding
the weights into the model's arrays: what ``PSClient.push_pull(out=)`` will do once switched
over (docs/flight.md), short of retries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import psworker
from bench import peers, torchps
from bench.timing import Step


def _serve(conn: Connection) -> None:
    """Child process: one Shard behind a control port and a Flight data port."""
    from psserver.flight_service import start_flight_service
    from psserver.server import start_server
    from psserver.shard import Shard

    shard = Shard()
    control = start_server(shard)
    data = start_flight_service(shard)
    conn.send((control.address, data.address))
    try:
        with contextlib.suppress(EOFError):
            conn.recv()
    finally:
        data.stop(1.0)
        control.stop(0.5)


@contextlib.contextmanager
def service_step(shapes: dict[str, tuple[int, ...]], shards: int) -> Iterator[Step]:
    """A step callable: push_pull of the bench model through the built Flight data port."""
    from psworker.flight_link import FlightLink

    model = torchps.model_arrays(shapes)
    grads = {k: np.full_like(v, 1e-4) for k, v in model.items()}
    with contextlib.ExitStack() as stack:
        pairs = []
        for _ in range(shards):
            pair, stop = peers.start_child(_serve)
            stack.callback(stop)
            pairs.append(pair)
        client: Any = stack.enter_context(
            psworker.connect([c for c, _ in pairs], worker_id=0, num_workers=1, mode="async")
        )
        client.init(model, psworker.SGD(lr=1e-3))
        links = [FlightLink(i, d, 0, peers.RPC_TIMEOUT_S) for i, (_, d) in enumerate(pairs)]
        for link in links:
            stack.callback(link.close)
        pool = stack.enter_context(futures.ThreadPoolExecutor(max_workers=shards))
        shard_map = client._require_map()
        wanted = [v.name for v in shard_map.variables]
        into = shard_map.destinations(wanted, model)
        nbytes = sum(v.nbytes for v in model.values())

        def step() -> None:
            pieces = client._pieces(grads)
            at = client.step

            def one(s: int) -> dict[str, np.ndarray]:
                pushed, arrays = links[s].push_pull(at, pieces[s], into)
                if not pushed.applied:
                    raise RuntimeError(f"shard {s} did not apply step {at}: {pushed.reason}")
                return arrays

            parts = list(pool.map(one, range(shards))) if shards > 1 else [one(0)]
            client.step = at + 1
            merged: dict[str, np.ndarray] = {}
            for p in parts:
                merged.update(p)
            got = shard_map.join(merged, wanted, into, model)
            if sum(w.nbytes for w in got.values()) != nbytes:
                raise RuntimeError("the Flight service returned the wrong number of bytes")

        yield step
