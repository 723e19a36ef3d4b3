"""This worker process's part in a job: its settings for every shard, the job id it trains,
its heartbeats, and which workers the shards say are absent."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from pswire.errors import ModelMismatchError, PSError
from pswire.proto import ps_pb2
from pswire.stubs import ParameterServerStub

log = logging.getLogger(__name__)
# A worker keeps its pushes since the shard's newest checkpoint, to replay them if the shard
# restarts: at most this many bytes per shard (or four pushes, if more); when full it asks the
# shard to checkpoint, then forgets what the checkpoint holds.
DEFAULT_REPLAY_BYTES = 64 << 20
DATA_PLANES = ("auto", "grpc")
# Calls moving fewer tensor bytes than this each way travel in grpcio's message form (a step in
# one message each way on the data port's step exchange where the shard has one, else on the
# grpcio step stream; a lone push or pull on grpcio), larger ones as record batches on the
# Flight data port: where each measured faster (`python -m bench.transport_sizes`, one shard,
# loaded 2-core machine: grpcio's form 3-11% faster from 4 KB to 128 KB, batches 2-6% faster
# from 256 KB to 16 MB; bench/NOTES.md 36 for the step exchange). The client setting
# ``grpc_below_bytes`` (``$PS_GRPC_BELOW_BYTES``) overrides it (0: batches for every size).
GRPC_BELOW_BYTES = 256 << 10


@dataclass(frozen=True)
class LinkConfig:
    """What every link of one client shares."""

    worker_id: int
    num_workers: int
    timeout: float
    retry_s: float
    chunk_bytes: int
    session: str = ""  # this client process's id (one process per worker id)
    replay_bytes: int = DEFAULT_REPLAY_BYTES
    # How tensors travel (psworker/transport.py): "auto" uses a shard's Flight data port when
    # its registration names one, "grpc" never does (the control port's grpcio calls).
    data_plane: str = "auto"
    # Calls moving fewer tensor bytes than this each way travel in grpcio's message form (a
    # step on the data port's step exchange, where there is one; see GRPC_BELOW_BYTES).
    grpc_below_bytes: int = GRPC_BELOW_BYTES

    def __post_init__(self) -> None:
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {self.data_plane!r}")


class JobIdentity:
    """The job id this worker trains, as the shards report it (or as the user fixed it): a
    shard that reports another is refused, so a model is never mixed from two runs."""

    def __init__(self, fixed: str = "") -> None:
        self.value = fixed
        self._lock = threading.Lock()

    def check(self, seen: str, where: str) -> None:
        """Learns ``seen`` if no id is known yet; refuses a different one.

        Raises:
            ModelMismatchError: ``where`` holds another job.
        """
        if not seen:
            return  # the shard has no job yet, or only a provisional one
        with self._lock:
            if not self.value:
                self.value = seen
                return
            if seen != self.value:
                raise ModelMismatchError(
                    f"{where} holds job {seen}, but this worker trains job {self.value}: the "
                    "shard was restored from another run's checkpoint (or restarted empty while "
                    "the others kept theirs); refusing to mix two runs. Restore every shard from "
                    "the same run, or clear the checkpoint folders to start anew"
                )


# The most often a worker heartbeats, whatever timeout a shard has (20 calls/s per shard).
MIN_HEARTBEAT_S = 0.05


class Beating(Protocol):
    """What a heartbeat needs of a shard's link (``ShardLink`` is one)."""

    @property
    def index(self) -> int: ...

    @property
    def stub(self) -> ParameterServerStub: ...


class Leaving(Beating, Protocol):
    """What leaving a job needs of a shard's link."""

    def leave(self, joined: bool = True) -> None: ...


class Joined(Protocol):
    """What leaving at exit needs of a client (``PSClient`` is one)."""

    @property
    def closed(self) -> bool: ...

    @property
    def links(self) -> Sequence[Leaving]: ...

    @property
    def shard_map(self) -> object | None: ...

    def close(self) -> None: ...


class Heartbeats:
    """A background thread telling every shard, every ``interval`` seconds, that this worker
    is alive (0: none)."""

    def __init__(self, links: Sequence[Beating], interval: float, worker: int, session: str):
        self._links = links
        self.interval = interval
        self._request = ps_pb2.HeartbeatRequest(worker_id=worker, session=session)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name = f"ps-heartbeat-{worker}"

    def start(self, shard_timeout_s: float = 0.0) -> None:
        """Starts beating, at least four times per the shards' heartbeat timeout (the shortest
        of them, 0: none), so that a shard's rule for its own stalls (it heard nobody for half
        the timeout) never mistakes this worker's quiet for one; never more often than every
        ``MIN_HEARTBEAT_S``, whatever a shard asks."""
        quarter = max(MIN_HEARTBEAT_S, shard_timeout_s / 4)
        if shard_timeout_s > 0 and quarter < self.interval:
            log.info(
                "heartbeat every %.2fs, not %.2fs: a quarter of the shards' %.2fs timeout",
                quarter,
                self.interval,
                shard_timeout_s,
            )
            self.interval = quarter
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for link in self._links:
                try:
                    link.stub.Heartbeat(self._request, timeout=max(1.0, self.interval))
                except grpc.RpcError as exc:  # the training calls report and recover
                    log.debug("heartbeat to shard %d failed: %s", link.index, exc.code())


class AbsentWorkers:
    """The workers the shards report out of the quorum; a change is logged (a warning when
    workers drop out: steps go on without them)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.current: frozenset[int] = frozenset()

    def update(self, replies: Iterable[ps_pb2.PushResponse]) -> None:
        absent = frozenset(w for r in replies for w in r.absent_workers)
        if absent == self.current:
            return
        if absent - self.current:
            log.warning(
                "workers %s are out of the quorum (silent past the shards' heartbeat timeout, "
                "or left the job): steps now go on without them",
                sorted(absent - self.current),
            )
        if self.current - absent:
            log.info("workers %s are back in the quorum", sorted(self.current - absent))
        self.current = absent


def say_resumed(worker: int, job: str, step: int) -> None:
    """Warns that this worker joins a job the shards already trained to ``step`` (> 0): a
    script that restarts its own epoch count and schedule would otherwise not notice."""
    if step > 0:
        log.warning(
            "worker %d joins job %s already at step %d (the shards resumed it, e.g. from a "
            "checkpoint, or it is an elastic job that trained on): training goes on from "
            "there. Start the epoch loop at "
            "psworker.start_epoch(client, steps_per_epoch) (client.step // steps_per_epoch); "
            "to start a new job instead, start the shards with --fresh (psctl local --fresh)",
            worker,
            job or "?",
            step,
        )


def leave_at_exit(client: Joined) -> None:
    """Makes ``client`` leave the job at interpreter exit if the script never closed it: the
    others need not wait out the shards' heartbeat timeout to go on without this worker."""
    atexit.register(_leave, weakref.ref(client))


def _leave(ref: weakref.ref[Joined]) -> None:
    # One shard after another: the thread pools that close() fans out on are shut down by now.
    client = ref()
    if client is None or client.closed:
        return
    joined = client.shard_map is not None  # else its init failed: it gives up its id's claim
    for link in client.links:
        link.leave(joined)
    with contextlib.suppress(PSError):
        client.close()
