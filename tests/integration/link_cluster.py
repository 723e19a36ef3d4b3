"""A shard server and one worker's link to it, for the replay link's tests (psworker/link.py):
restarts are scheduled (``Cluster.restart``), faults come from ``faults.FaultPlan``."""

from __future__ import annotations

from typing import Any

import numpy as np
from faults import FaultPlan, flight_faults

import psworker
from pscore.optim import SGD
from psserver.records import Limits, ShardState
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.proto import ps_pb2
from psworker.link import ShardLink
from psworker.session import GRPC_BELOW_BYTES

LIMITS = Limits(max_wait_s=5)


def grad(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(2, step + 1, np.float32)}


def served(shard: Shard, port: int = 0, **server: Any) -> RunningServer:
    shard.checkpointing = True  # as a CheckpointScheduler marks it: workers keep a replay log
    return start_server(shard, port=port, **server)


class Cluster:
    """One shard server and a worker's link to it, on a channel with fault plans."""

    def __init__(
        self,
        *plans: FaultPlan,
        retry_s: float = 10.0,
        mode: str = "async",
        workers: int = 1,
        timeout: float = 5.0,
        worker: int = 0,
        size: int = 2,
        limits: Limits = LIMITS,
        grpc_below_bytes: int = GRPC_BELOW_BYTES,
        data_plane: str = "auto",
        **server: Any,
    ) -> None:
        """``size``: of the model's one variable ``w``; ``limits``: the shard's;
        ``grpc_below_bytes``: the client's (0: every step in record batches on the Flight
        data port); ``data_plane``: the client's ("grpc": every tensor on grpcio);
        ``server``: start_server's options (e.g. ``stream_idle_s``)."""
        self.server = served(Shard(limits), **server)
        self.port = int(self.server.address.rsplit(":", 1)[1])
        values = {"w": np.zeros(size, np.float32)}
        if worker:  # worker 0 sends the initial values first
            chief_settings = psworker.ClientSettings(
                addresses=(self.server.address,), num_workers=workers, mode=mode, heartbeat_s=0
            )
            with psworker.PSClient(chief_settings) as chief:
                chief.init(values, SGD(lr=1.0))
        settings = psworker.ClientSettings(
            addresses=(self.server.address,),
            worker_id=worker,
            num_workers=workers,
            mode=mode,
            timeout=timeout,
            retry_s=retry_s,
            heartbeat_s=0,
            interceptors=tuple(plans),
            grpc_below_bytes=grpc_below_bytes,
            data_plane=data_plane,
        )
        self.client = psworker.PSClient(settings)
        self.client.init(values, SGD(lr=1.0))
        flight_faults(self.client, plans)  # the same faults on the data port
        self.link: ShardLink = self.client.links[0]
        for plan in plans:  # count from here: the calls init made are not the test's
            plan.calls = plan.fired = 0

    def restart(self, state: ShardState | None) -> None:
        """As kill -9 and a restart on the same port: from ``state``, or with nothing."""
        self.server.stop(grace=0)
        shard = Shard(LIMITS)
        if state is not None:
            shard.restore(state)
        self.server = served(shard, self.port)

    def weights(self) -> np.ndarray:
        return self.server.shard.snapshot()["w"]

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=0)


def pull_request(step: int = 0) -> ps_pb2.PullRequest:
    return ps_pb2.PullRequest(worker_id=0, step=step, names=["w"])
