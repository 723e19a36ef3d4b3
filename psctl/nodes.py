"""Several ``psctl local`` launchers as one job (``--nnodes``, ``--node-rank``, ``--rdzv``), as
torchrun's nodes: node 0 hosts torch's ``TCPStore`` at ``--rdzv``; through it every node checks
it runs the same job, publishes its shards' addresses and learns the others', takes its worker
id range, beats, and says when its workers are done.

Fixed size (``--nnodes N``): every node waits for all N, the job's shards are every node's in
node order, node i's workers take the ids after those of nodes 0..i-1, and a node that fails or
goes silent stops every other node with an error naming it. Elastic (``--nnodes MIN:MAX``):
the shards run on node 0 only (the model must outlive any node that leaves), node i's workers
take ids ``[i*W, (i+1)*W)`` of an elastic job of ``MIN*W`` to ``MAX*W`` workers, node 0 starts
once MIN nodes are in, later nodes join the running job, a node that leaves is reported while
the rest go on, and a launcher started again with a rank whose holder has been silent for the
node timeout takes it back (its workers rejoin under their old ids). torch is imported only
here (``psworker.ring.rendezvous``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pscore.job import MODES
from psworker.elastic import parse_bounds
from psworker.ring.rendezvous import local_host_towards, open_store

DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_NODE_TIMEOUT_S = 15.0
_BEAT_S = 1.0
_POLL_S = 0.2
# What every node must agree on; node 0's values are the job's.
_AGREED = ("mode", "staleness", "nnodes")


class NodeError(Exception):
    """Raised when the nodes cannot form, or keep, one job; the message says which node."""


@dataclass(frozen=True)
class NodesConfig:
    """This launcher's place among the nodes (``--nnodes``, ``--node-rank``, ``--rdzv``)."""

    nnodes: str  # "N" or "MIN:MAX"
    node_rank: int
    rdzv: str  # host:port of node 0's store
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S

    def __post_init__(self) -> None:
        _, high = self.bounds  # raises ConfigError (a ValueError) when malformed
        host, sep, port = self.rdzv.rpartition(":")
        problems = []
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"--rdzv must be HOST:PORT, got {self.rdzv!r}")
        if not 0 <= self.node_rank < high:
            problems.append(f"--node-rank must be in [0, {high}) for --nnodes {self.nnodes}")
        if not self.join_timeout_s > 0:
            problems.append(f"--join-timeout must be > 0 seconds, got {self.join_timeout_s}")
        if not self.node_timeout_s >= 2 * _BEAT_S:
            problems.append(
                f"--node-timeout must be >= {2 * _BEAT_S:g} seconds (nodes beat every "
                f"{_BEAT_S:g} s), got {self.node_timeout_s}"
            )
        if problems:
            raise ValueError("; ".join(problems))

    def refusals(self, mode: str, elastic: str | None) -> list[str]:
        """Why this node cannot run a ``psctl local`` job in ``mode`` (with ``--elastic``)."""
        problems = []
        if elastic is not None:
            problems.append("--elastic and --nnodes: give an elastic range as --nnodes MIN:MAX")
        if self.elastic and mode not in MODES:
            problems.append(
                f"--nnodes {self.nnodes} (elastic) needs a parameter-server mode {MODES}, "
                f"not {mode}"
            )
        if mode == "local":
            problems.append("--mode local runs one process; it cannot span nodes")
        return problems

    @property
    def bounds(self) -> tuple[int, int]:
        text = self.nnodes if ":" in self.nnodes else f"{self.nnodes}:{self.nnodes}"
        return parse_bounds(text, "--nnodes")

    @property
    def elastic(self) -> bool:
        low, high = self.bounds
        return low < high

    @property
    def host(self) -> str:
        return self.rdzv.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.rdzv.rpartition(":")[2])


@dataclass(frozen=True)
class Layout:
    """What this node runs in the job: every shard, its worker ids, the job's worker count."""

    shards: list[str]
    first_worker: int
    num_workers: int  # fixed size: all nodes' workers; elastic: the most there may be
    elastic: str | None  # the workers' "MIN:MAX", or None for a fixed-size job
    job_id: str


class Nodes:
    """This node's side of the rendezvous: join, exchange, beat, watch the others, finish."""

    def __init__(
        self, config: NodesConfig, timeout_s: float, interrupted: Callable[[], None]
    ) -> None:
        """Hosts (node 0) or reaches the store; ``interrupted`` is called during every wait
        and may raise to end it (a signal, the run's deadline).

        Raises:
            UnavailableError: the store could not be hosted or reached within the join timeout.
        """
        self.config = config
        self.rank = config.node_rank
        self._interrupted = interrupted
        self._store = open_store(
            config.host,
            config.port,
            config.bounds[1],
            self.rank == 0,
            config.join_timeout_s,
            interrupted,
        )
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None
        self._beat_error: str | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last beat count, when seen)
        self._gone: set[int] = set()
        self._timeout_s = timeout_s

    @property
    def bind_host(self) -> str:
        """Where this node's shards listen and are reached: its address towards node 0."""
        return local_host_towards(self.config.host)

    # -- forming the job ---------------------------------------------------------------------

    def agree(self, job: dict[str, Any]) -> None:
        """Node 0 publishes the job's settings; the others check theirs are the same.

        Raises:
            NodeError: this node rank is taken, or a setting differs from node 0's.
        """
        if int(self._store.add(f"claim/{self.rank}", 1)) > 1:
            self._rejoin()
        job = {**job, "nnodes": self.config.nnodes}
        if self.rank == 0:
            self._store.set("job", json.dumps({**job, "job_id": f"nodes-{time.time_ns():x}"}))
            return
        self._wait(["job"], "node 0's job settings")
        theirs = json.loads(bytes(self._store.get("job")).decode())
        for key in (*_AGREED, *(("workers",) if self.config.elastic else ())):
            if theirs.get(key) != job.get(key):
                raise NodeError(
                    f"node {self.rank} has {key} {job.get(key)!r} but node 0 has "
                    f"{theirs.get(key)!r}: every node must run the same job"
                )

    def _rejoin(self) -> None:
        """This node rank was claimed before: an elastic job takes it back when its last
        holder has been silent for the node timeout (it left; its worker ids rejoin).

        Raises:
            NodeError: a fixed-size job, or the rank's holder still beats.
        """
        taken = (
            f"node rank {self.rank} is already taken in the job at {self.config.rdzv}: give each "
            "launcher its own --node-rank"
        )
        if not self.config.elastic or self.rank == 0:
            raise NodeError(taken)
        before = int(self._store.add(f"beat/{self.rank}", 0))
        deadline = time.monotonic() + self.config.node_timeout_s
        while time.monotonic() < deadline:
            if int(self._store.add(f"beat/{self.rank}", 0)) != before:
                raise NodeError(f"{taken} (its launcher still beats)")
            self._interrupted()
            time.sleep(_POLL_S)
        with contextlib.suppress(Exception):  # a rank that left after finishing
            self._store.delete_key(f"done/{self.rank}")
            self._store.delete_key(f"exited/{self.rank}")

    def join(self, shards: list[str], workers: int) -> Layout:
        """Publishes this node's shards and worker count, waits for the others (all of them,
        or node 0 and MIN in all when elastic) and returns the job as this node runs it.

        Raises:
            NodeError: the nodes did not all arrive within the join timeout (named).
        """
        low, high = self.config.bounds
        self._store.set(f"node/{self.rank}", json.dumps({"shards": shards, "workers": workers}))
        if self.config.elastic:
            self._wait(["node/0"], "node 0 (it hosts the shards)")
            if self.rank == 0:
                self._wait_count(low)
            node0 = self._node(0)
            return Layout(
                shards=node0["shards"],
                first_worker=self.rank * workers,
                num_workers=high * workers,
                elastic=f"{low * workers}:{high * workers}",
                job_id=self._job_id(),
            )
        self._wait([f"node/{i}" for i in range(high)], f"all {high} nodes")
        nodes = [self._node(i) for i in range(high)]
        return Layout(
            shards=[a for n in nodes for a in n["shards"]],
            first_worker=sum(int(n["workers"]) for n in nodes[: self.rank]),
            num_workers=sum(int(n["workers"]) for n in nodes),
            elastic=None,
            job_id=self._job_id(),
        )

    def _job_id(self) -> str:
        return str(json.loads(bytes(self._store.get("job")).decode())["job_id"])

    def _node(self, rank: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(bytes(self._store.get(f"node/{rank}")).decode())
        return data

    def _joined(self) -> list[int]:
        return [i for i in range(self.config.bounds[1]) if self._store.check([f"node/{i}"])]

    def _wait_count(self, count: int) -> None:
        self._poll(lambda: len(self._joined()) >= count, f"at least {count} nodes")

    def _wait(self, keys: list[str], what: str) -> None:
        self._poll(lambda: all(self._store.check([k]) for k in keys), what)

    def _poll(self, done: Callable[[], bool], what: str) -> None:
        """Polls ``done`` until true (interruptible, unlike a store wait).

        Raises:
            NodeError: not within the join timeout; the message names who joined.
        """
        deadline = time.monotonic() + self.config.join_timeout_s
        while not done():
            if time.monotonic() >= deadline:
                joined = self._joined()
                missing = [i for i in range(self.config.bounds[0]) if i not in joined]
                raise NodeError(
                    f"node {self.rank}: {what} did not arrive at {self.config.rdzv} within "
                    f"{self.config.join_timeout_s:g} s (joined: nodes {joined}; still missing: "
                    f"nodes {missing}; --nnodes {self.config.nnodes})"
                )
            self._interrupted()
            time.sleep(_POLL_S)

    # -- while it runs -----------------------------------------------------------------------

    def start_beating(self) -> None:
        """Beats every second on a connection of its own (a store client is not shared)."""
        store = open_store(
            self.config.host, self.config.port, self.config.bounds[1], False, self._timeout_s
        )

        def beat() -> None:
            while not self._stop.is_set():
                try:
                    store.add(f"beat/{self.rank}", 1)
                except Exception as exc:
                    self._beat_error = str(exc)
                    return
                self._stop.wait(_BEAT_S)

        self._beater = threading.Thread(target=beat, name="node-beat", daemon=True)
        self._beater.start()

    def check(self) -> list[str]:
        """What changed among the other nodes since the last call: lines to print.

        Raises:
            NodeError: the job cannot go on: node 0's store is gone, a node failed, or (fixed
                size) a node went silent.
        """
        if self._beat_error is not None:
            raise NodeError(
                f"lost node 0's rendezvous store at {self.config.rdzv} ({self._beat_error}): "
                "node 0 is gone (killed, or its machine is down); the job cannot go on without it"
            )
        news = []
        now = time.monotonic()
        try:
            joined = self._joined()
            for rank in joined:
                if rank == self.rank:
                    continue
                if rank in self._gone:
                    if int(self._store.add(f"beat/{rank}", 0)) != self._seen[rank][0]:
                        self._gone.discard(rank)
                        self._seen[rank] = (int(self._store.add(f"beat/{rank}", 0)), now)
                        news.append(f"node {rank} rejoined the job")
                    continue
                done = self._store.check([f"done/{rank}"])
                if done:
                    code = int(bytes(self._store.get(f"done/{rank}")).decode())
                    if code != 0 and not self.config.elastic:
                        raise NodeError(f"node {rank} failed with exit code {code}; stopping")
                    continue
                count = int(self._store.add(f"beat/{rank}", 0))
                last = self._seen.get(rank)
                if last is None or last[0] != count:
                    if last is None and self.config.elastic and rank != 0:
                        news.append(f"node {rank} joined the job")
                    self._seen[rank] = (count, now)
                elif now - last[1] > self.config.node_timeout_s:
                    silent = f"node {rank} has been silent for {now - last[1]:.0f} s"
                    if not self.config.elastic or rank == 0:
                        raise NodeError(
                            f"{silent} (killed, or its machine is down); a fixed-size job "
                            "cannot go on without its shards and workers; stopping (--nnodes "
                            "MIN:MAX makes an elastic job, whose nodes may leave)"
                        )
                    self._gone.add(rank)
                    news.append(f"{silent}: it left the job; the elastic job goes on")
        except NodeError:
            raise
        except Exception as exc:
            raise NodeError(
                f"lost node 0's rendezvous store at {self.config.rdzv} ({exc}): node 0 is gone"
            ) from None
        return news

    def settle(
        self, code: int, serving: bool, tick: Callable[[], None], say: Callable[[str], None]
    ) -> None:
        """This node's workers are done with ``code``: tells the others, and while this node
        serves them (its shards, or node 0's store) waits until they are done too. ``tick``
        is called between polls (it sleeps, and raises to give up)."""
        with contextlib.suppress(Exception):  # node 0 gone: nobody to tell
            self._store.set(f"done/{self.rank}", str(code))
        if code != 0 or not (serving or self.rank == 0):
            return
        waiting = self.others_running()
        if waiting:
            say(f"this node's workers are done; waiting for nodes {waiting}")
        while waiting:
            tick()
            for line in self.check():
                say(line)
            waiting = self.others_running()

    def release(self, serving: bool, tick: Callable[[], None], say: Callable[[str], None]) -> None:
        """Node 0: the job is over (exported if asked), the others may stop their shards. The
        others, when ``serving``: wait for that (or for node 0 to be gone)."""
        if self.rank == 0:
            with contextlib.suppress(Exception):
                self._store.set("released", "1")
            self._await_exits(tick)
            return
        if serving:
            say("waiting for node 0 to release this node's shards")
            while not self._released():
                tick()

    def _await_exits(self, tick: Callable[[], None]) -> None:
        """Node 0's exit barrier (torch elastic has one too): its store goes when this process
        ends, so it stays up until every other node that joined and is not gone has said it is
        through with it (``close``), or for the node timeout at most (a node killed meanwhile
        never says). A node still waiting for node 0's ``done`` or ``released`` would otherwise
        read the vanished store as node 0 having died, and fail a finished job."""
        deadline = time.monotonic() + self.config.node_timeout_s
        while time.monotonic() < deadline:
            try:
                pending = [
                    r
                    for r in self._joined()
                    if r != self.rank
                    and r not in self._gone
                    and not self._store.check([f"exited/{r}"])
                ]
            except Exception:
                return
            if not pending:
                return
            tick()

    def _released(self) -> bool:
        try:
            return bool(self._store.check(["released"]))
        except Exception:
            return True  # node 0 is gone: nothing to wait for

    def others_running(self) -> list[int]:
        """Nodes that joined, are neither done nor gone (what this node's shards may serve)."""
        return [
            r
            for r in self._joined()
            if r != self.rank and r not in self._gone and not self._store.check([f"done/{r}"])
        ]

    def close(self) -> None:
        """Tells node 0 this node is through with its store (its exit barrier), stops beating."""
        if self.rank != 0:
            with contextlib.suppress(Exception):  # node 0 gone: nobody to tell
                self._store.set(f"exited/{self.rank}", "1")
        self._stop.set()
        if self._beater is not None:
            self._beater.join(timeout=2.0)
