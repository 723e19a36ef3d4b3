"""One timeout story: the worker's deadline travels with each call, and the shard answers
before it, naming what it waited for, so the user reads the shard's reason, not a bare
client-side timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import psworker
import psworker.stepstream
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.servicer import DEADLINE_MARGIN_S
from psserver.shard import Shard
from psworker.settings import DEFAULT_TIMEOUT_S

MODEL = {"w": np.zeros(3, np.float32)}
GRAD = {"w": np.ones(3, np.float32)}
TIMEOUT_S = 1.5
# A shard that waits far longer than the worker: only the worker's deadline can end the wait,
# and no worker is dropped for silence.
PATIENT = Limits(max_wait_s=300.0, heartbeat_timeout_s=0)


@pytest.fixture
def stalled_job() -> Iterator[Callable[[], psworker.PSClient]]:
    """A sync job of 2 on one shard whose worker 1 registered but never pushes; yields a
    factory of worker 0 clients (timeout TIMEOUT_S) that have called init."""
    server: RunningServer = start_server(Shard(PATIENT))
    clients: list[psworker.PSClient] = []

    def connect(worker: int) -> psworker.PSClient:
        client = psworker.connect(
            [server.address], worker_id=worker, num_workers=2, mode="sync", timeout=TIMEOUT_S
        )
        assert isinstance(client, psworker.PSClient)
        clients.append(client)
        return client

    idle = connect(1)
    waiting = threading.Thread(target=idle.init, args=(MODEL, psworker.SGD(lr=0.1)))
    waiting.start()
    first = connect(0)
    first.init(MODEL, psworker.SGD(lr=0.1))
    waiting.join(timeout=10)
    yield lambda: first
    for client in clients:
        client.close()
    server.stop(grace=0.5)


def assert_shards_reason(error: psworker.WaitTimeoutError) -> None:
    text = str(error)
    assert "still waiting for workers [1]" in text, text
    assert "no reply within" not in text and "no answer within" not in text, text


@pytest.mark.timeout(30)
def test_step_stream_shows_the_shards_reason(
    stalled_job: Callable[[], psworker.PSClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's watchdog looks every millisecond: only a shard that answers before the
    # deadline (not at it) gets its reason through.
    monkeypatch.setattr(psworker.stepstream, "WATCH_TICK_S", 0.001)
    client = stalled_job()
    for _ in range(3):
        with pytest.raises(psworker.WaitTimeoutError) as info:
            client.push_pull(GRAD)
        assert_shards_reason(info.value)
        assert f"gave up after {TIMEOUT_S - DEADLINE_MARGIN_S:.1f}s" in str(info.value)


@pytest.mark.timeout(30)
def test_unary_pull_shows_the_shards_reason(stalled_job: Callable[[], psworker.PSClient]) -> None:
    client = stalled_job()
    client.push(GRAD)  # accepted at once; the next step's weights wait for worker 1
    with pytest.raises(psworker.WaitTimeoutError) as info:
        client.pull()
    assert_shards_reason(info.value)
    assert "Pull on shard 0" in str(info.value)


def test_default_worker_timeout_is_inside_the_shards_longest_wait() -> None:
    # With both defaults, the worker's deadline ends a wait first; the shard answers before
    # it (the tests above), so its reason is what the user reads.
    assert Limits().max_wait_s > DEFAULT_TIMEOUT_S + DEADLINE_MARGIN_S
