"""A hostile or careless client against a real daemon: idle streams and abandoned waits must not
take the shard from everyone else (issue 14, item 10)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from e2e_support import Processes, child_env, numpy_worker
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psworker
from pscore.optim import SGD
from psserver.admission import ANONYMOUS_GRACE_S, ANONYMOUS_STREAMS_PER_PEER
from pswire.proto import ps_pb2
from pswire.stubs import ParameterServerStub
from pswire.write import push_pull_request

THREADS = 16
RESERVED = 8  # psserver.admission.RESERVED_THREADS: threads no waiting or streaming call takes
ANSWER_S = 2.0  # the bound for Status and health under that load
IDLE_S = 2.0


def channel(address: str) -> grpc.Channel:
    """A channel on its own TCP connection: another client, not a stream on the attacker's."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def idle(stop: threading.Event, *first: Any) -> Iterator[Any]:
    """A request stream that sends ``first`` and then nothing until ``stop`` (never closes on
    its own: the client neither sends nor half-closes)."""
    yield from first
    stop.wait(120)


class Outcomes:
    """Status codes of calls as they end, and when."""

    def __init__(self) -> None:
        self.ended: dict[int, tuple[grpc.StatusCode, float]] = {}
        self.lock = threading.Lock()

    def watch(self, index: int, call: grpc.Future) -> None:
        def done(finished: grpc.Future) -> None:
            with self.lock:
                self.ended[index] = (finished.code(), time.monotonic())

        call.add_done_callback(done)

    def codes(self) -> list[grpc.StatusCode]:
        with self.lock:
            return [code for code, _ in self.ended.values()]

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def assert_answerable(address: str, window: float, num_workers: int = 1) -> None:
    """Status, RegisterWorker and the health check from a second client each answer within
    ANSWER_S, asked again and again for ``window`` seconds (the load is in place by then)."""
    with channel(address) as ch:
        stub = ParameterServerStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        until = time.monotonic() + window
        rounds = 0
        while rounds < 2 or time.monotonic() < until:
            stub.Status(ps_pb2.StatusRequest(), timeout=ANSWER_S)
            check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=ANSWER_S)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            request = ps_pb2.RegisterWorkerRequest(worker_id=0, num_workers=num_workers)
            stub.RegisterWorker(request, timeout=ANSWER_S)
            rounds += 1
            time.sleep(0.2)


def init_job(address: str, mode: str, num_workers: int) -> psworker.PSClient:
    """Worker 0's client, with a small job initialised (kept open: the caller closes it)."""
    client = psworker.connect(
        [address], worker_id=0, num_workers=num_workers, mode=mode, timeout=30
    )
    client.init({"w": np.zeros(4, np.float32)}, SGD(lr=0.1))
    return client


@pytest.mark.timeout(120)
def test_status_and_health_answer_while_threads_idle_streams_are_open(procs: Processes) -> None:
    daemon = procs.psserver("--threads", str(THREADS))
    stop = threading.Event()
    outcomes = Outcomes()
    calls = []
    attacker = channel(daemon.address)
    try:
        stub = ParameterServerStub(attacker)
        for i in range(THREADS):
            if i % 2:
                call = stub.PushPullStream(idle(stop), timeout=90)
            else:
                call = stub.Push.future(idle(stop), timeout=90)
            outcomes.watch(i, call)
            calls.append(call)
        assert_answerable(daemon.address, window=4.0)
        # Every idle call reached the shard: those past the cap were refused at once, the
        # rest hold their threads (until, sending nothing, all but a few of this peer's are
        # cancelled: test_idle_streams_of_one_peer_do_not_shut_out_the_workers).
        limit = THREADS - RESERVED
        refused = lambda: outcomes.codes().count(grpc.StatusCode.RESOURCE_EXHAUSTED)  # noqa: E731
        outcomes.wait(lambda: refused() >= THREADS - limit, timeout=10)
        assert refused() == THREADS - limit, outcomes.codes()
        others = [c for c in outcomes.codes() if c != grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert set(others) <= {grpc.StatusCode.CANCELLED}, outcomes.codes()
        assert daemon.proc.poll() is None
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        attacker.close()


@pytest.mark.timeout(120)
def test_idle_streams_of_one_peer_do_not_shut_out_the_workers(procs: Processes) -> None:
    # The default idle timeout (120 s): without a per-peer cap, the worker waits it out.
    daemon = procs.psserver("--threads", str(THREADS))
    stop = threading.Event()
    outcomes = Outcomes()
    calls = []
    attacker = channel(daemon.address)
    client = psworker.connect([daemon.address], worker_id=0, num_workers=1, mode="async")
    try:
        stub = ParameterServerStub(attacker)
        limit = THREADS - RESERVED
        # Every thread a waiting or streaming call may take: step streams sending nothing, so
        # no worker id. The worker below shares the peer's host (127.0.0.1).
        for i in range(limit):
            call = stub.PushPullStream(idle(stop), timeout=90)
            outcomes.watch(i, call)
            calls.append(call)
        # A worker gets through within the grace and a margin.
        deadline = time.monotonic() + ANONYMOUS_GRACE_S + 15.0
        while True:
            try:
                client.init({"w": np.ones(4, np.float32)}, SGD(lr=0.1))
                pulled = client.pull()
                break
            except psworker.PSError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert np.array_equal(pulled["w"], np.ones(4, np.float32))
        # The peer keeps at most ANONYMOUS_STREAMS_PER_PEER of its streams; the rest were
        # cancelled (or, when the worker's call came first on a loaded machine, refused).
        kept = ANONYMOUS_STREAMS_PER_PEER
        assert outcomes.wait(lambda: len(outcomes.codes()) >= limit - kept, timeout=10)
        ended = {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert set(outcomes.codes()) <= ended, outcomes.codes()
        assert grpc.StatusCode.CANCELLED in outcomes.codes(), outcomes.codes()
        # And the job trains on.
        client.push({"w": np.ones(4, np.float32)})
        assert np.allclose(client.pull()["w"], 0.9)
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        attacker.close()
        client.close()


@pytest.mark.timeout(120)
def test_cancelled_waiting_pulls_free_the_shard_at_once(procs: Processes) -> None:
    daemon = procs.psserver("--threads", str(THREADS))
    client = init_job(daemon.address, "sync", num_workers=2)
    outcomes = Outcomes()
    calls = []
    attacker = channel(daemon.address)
    try:
        stub = ParameterServerStub(attacker)
        # Pulls for a step the job will not reach for minutes: each waits in the shard.
        future = ps_pb2.PullRequest(worker_id=0, step=5)
        for i in range(THREADS):
            call = stub.Pull(future, timeout=90)
            outcomes.watch(i, call)
            calls.append(call)
        # Those past the cap are refused at once: then every pull has reached the shard. (The
        # shard before the cap had no such sign; then the bounded wait just passes.)
        outcomes.wait(lambda: len(outcomes.codes()) >= RESERVED, timeout=5)
        for call in calls:
            call.cancel()
        assert_answerable(daemon.address, window=2.0, num_workers=2)
        # A normal pull is served within seconds: the cancelled waits gave their threads back
        # (the shard's --max-wait, 300 s, is not what ends them).
        normal = ps_pb2.PullRequest(worker_id=0, step=0)
        deadline = time.monotonic() + 5.0
        with channel(daemon.address) as ch:
            other = ParameterServerStub(ch)
            while True:
                try:
                    replies = list(other.Pull(normal, timeout=ANSWER_S))
                    break
                except grpc.RpcError as exc:
                    busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    if not busy or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        assert replies and replies[0].chunk.name == "w"
    finally:
        for call in calls:
            call.cancel()
        attacker.close()
        client.close()


@pytest.mark.timeout(90)
def test_an_idle_request_stream_is_cancelled_after_the_idle_timeout(procs: Processes) -> None:
    # The env twin of --stream-idle-timeout (a shard without the flag ignores it, and so shows
    # what happened before: the streams are never cancelled).
    daemon = procs.psserver(env=child_env(PS_STREAM_IDLE_TIMEOUT=str(IDLE_S)))
    client = init_job(daemon.address, "async", num_workers=1)
    stop = threading.Event()
    outcomes = Outcomes()
    calls = []
    attacker = channel(daemon.address)
    try:
        stub = ParameterServerStub(attacker)
        header = ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=0, step=0))
        step = push_pull_request(0, 0, {"w": np.ones(4, np.float32)})
        started = time.monotonic()
        opened = [
            stub.Push.future(idle(stop), timeout=30),  # never a message
            stub.Push.future(idle(stop, header), timeout=30),  # a header, then nothing
            stub.PushPullStream(idle(stop), timeout=30),  # never a message
            stub.PushPullStream(idle(stop, step), timeout=30),  # one step, then nothing
        ]
        for i, call in enumerate(opened):
            outcomes.watch(i, call)
            calls.append(call)
        first = next(opened[3])  # the one step is answered; then the stream idles
        assert first.push.applied
        outcomes.wait(lambda: len(outcomes.codes()) == len(opened), timeout=IDLE_S + 10)
        with outcomes.lock:
            ended = dict(outcomes.ended)
        assert sorted(ended) == list(range(len(opened))), ended
        for i, (code, at) in ended.items():
            assert code == grpc.StatusCode.CANCELLED, (i, code)
            # Not before the timeout, and within a few seconds of it.
            assert IDLE_S * 0.75 <= at - started <= IDLE_S + 5.0, (i, at - started)
        # The shard serves on as before (the one step the stream sent was step 0).
        client.push({"w": np.ones(4, np.float32)}, step=1)
        assert np.array_equal(client.pull()["w"], np.full(4, -0.2, np.float32))
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        attacker.close()
        client.close()


@pytest.mark.timeout(90)
def test_a_worker_holds_at_most_two_open_step_streams(procs: Processes) -> None:
    daemon = procs.psserver()
    client = init_job(daemon.address, "async", num_workers=1)
    stop = threading.Event()
    calls = []
    attacker = channel(daemon.address)
    try:
        stub = ParameterServerStub(attacker)
        grads = {"w": np.ones(4, np.float32)}
        for step in range(2):  # two open streams of worker 0, each after one step
            call = stub.PushPullStream(idle(stop, push_pull_request(0, step, grads)), timeout=60)
            calls.append(call)
            assert next(call).push.applied
        third = stub.PushPullStream(idle(stop, push_pull_request(0, 2, grads)), timeout=60)
        calls.append(third)
        with pytest.raises(grpc.RpcError) as refused:
            next(third)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "worker 0" in (refused.value.details() or "")
        # Once the two streams end, worker 0 may open another.
        stop.set()
        for call in calls[:2]:
            call.cancel()
        deadline = time.monotonic() + 10
        while True:
            fresh = stub.PushPullStream(iter([push_pull_request(0, 2, grads)]), timeout=10)
            try:
                assert next(fresh).push.applied
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        attacker.close()
        client.close()


@pytest.mark.timeout(120)
def test_pulls_never_read_do_not_shut_out_the_workers(procs: Processes) -> None:
    daemon = procs.psserver(
        "--threads", str(THREADS), env=child_env(PS_STREAM_IDLE_TIMEOUT=str(IDLE_S))
    )
    client = psworker.connect(
        [daemon.address], worker_id=0, num_workers=1, mode="async", timeout=30
    )
    attacker = channel(daemon.address)
    calls = []
    try:
        # 64 MiB: far more than the HTTP/2 flow-control window of a reader that never reads.
        client.init({"w": np.zeros(16 << 20, np.float32)}, SGD(lr=0.1))
        stub = ParameterServerStub(attacker)
        # No deadline and never read: the shard's send of each reply stalls.
        outcomes = Outcomes()
        for i in range(THREADS):
            calls.append(stub.Pull(ps_pb2.PullRequest(worker_id=0, step=0)))
            outcomes.watch(i, calls[-1])
        # Those past the cap are refused: the rest have reached the shard and hold their slots.
        assert outcomes.wait(lambda: len(outcomes.codes()) >= RESERVED, timeout=10)
        # Whatever an idle stream's limit, a worker's pull gets through within it and a margin.
        deadline = time.monotonic() + IDLE_S + 10.0
        while True:
            try:
                pulled = client.pull()
                break
            except psworker.PSError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert pulled["w"].shape == (16 << 20,)
    finally:
        for call in calls:
            call.cancel()
        attacker.close()
        client.close()


@pytest.mark.timeout(180)
def test_a_sync_job_within_the_documented_thread_rule_is_served(procs: Processes) -> None:
    # The rule psserver --help and the README state: 2 x workers (a step stream and a pull
    # each) + 8 kept for status and health.
    workers = 4
    daemon = procs.psserver("--threads", str(2 * workers + 8))
    running = [
        numpy_worker(procs, [daemon.address], i, workers, "--steps", "20", "--fused")
        for i in range(workers)
    ]
    for i, worker in enumerate(running):
        code = worker.proc.wait(timeout=150)
        assert code == 0, f"worker {i} exited {code}:\n{worker.text()}"
