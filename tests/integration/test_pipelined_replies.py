"""A sync round's reply streams back while its pushes still arrive (``fw.PIPELINED``,
psserver/pipeline.py): each variable's next value is predicted once every worker's gradient
of it is in, and a worker's reply carries it at once. The predictions are the round's own
values bit for bit (checked against a shard answering the same pushes sent whole), and a
prediction the shard cannot show held is never used: the call fails UNAVAILABLE, the round
is applied once, and the step sent again whole gets the round's weights."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from pathlib import Path

import numpy as np
import pytest

import psworker
from psserver import pipeline
from psserver import shard as shard_module
from psserver.flight_service import start_flight_service
from psserver.metrics import ShardMetrics
from psserver.records import Limits
from psserver.server import start_server
from psserver.shard import Shard
from pswire import flightwire as fw
from pswire.errors import InvalidRequestError, UnavailableError
from psworker.flight_link import FlightLink, FlightStream

pytestmark = pytest.mark.timeout(120)
N = 1 << 16  # 256 KiB a variable
REPO = Path(__file__).resolve().parents[2]
KEYS = ("a", "b", "c")  # "c": small, packed with others on the wire


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "a": rng.standard_normal(N).astype(np.float32),
        "b": rng.standard_normal(N).astype(np.float32),
        "c": rng.standard_normal(8).astype(np.float32),
    }


def _shard(stack: ExitStack, workers: int, mode: str = "sync") -> tuple[Shard, str]:
    """A shard of a job of ``workers`` (its data port's address), SGD with momentum: the
    preview steps optimizer slots too."""
    shard = Shard(Limits(max_wait_s=20.0))
    control = start_server(shard)
    stack.callback(control.stop, grace=0.5)
    metrics = ShardMetrics(shard, "ps0")
    shard.metrics = metrics  # type: ignore[attr-defined]  # the tests read it
    data = start_flight_service(shard, piece_bytes=64 << 10, metrics=metrics)
    stack.callback(data.stop)
    client = psworker.connect([control.address], worker_id=0, num_workers=workers, mode=mode)
    stack.callback(client.close)
    client.init(_initial(), psworker.SGD(lr=0.5, momentum=0.9))
    return shard, data.address


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _replies(shard: Shard, outcome: str) -> float:
    labels = {"shard": "ps0", "outcome": outcome}
    metrics: ShardMetrics = shard.metrics  # type: ignore[attr-defined]
    return metrics.registry.get_sample_value("psserver_pipelined_replies_total", labels) or 0.0


def _grads(step: int, worker: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + worker)
    return {
        k: (rng.standard_normal(v.shape) * 10.0**worker).astype(np.float32)
        for k, v in _initial().items()
    }


def _stream(link: FlightLink, step: int, into: dict[str, np.ndarray]) -> FlightStream:
    entries = [fw.manifest_entry(k, "float32", into[k].shape) for k in KEYS]
    return link.begin_stream(step, entries, into)


def _write(stream: FlightStream, grads: dict[str, np.ndarray], keys: tuple[str, ...]) -> None:
    stream.write([fw.encode_tensor(k, grads[k])[1] for k in keys])


@pytest.mark.parametrize("n", [2, 3])  # 3: the round sums into a push the preview reads
def test_a_round_s_weights_stream_back_before_it_closes_bit_identical_to_the_round(
    stack: ExitStack, n: int
) -> None:
    piped, piped_address = _shard(stack, n)
    whole, whole_address = _shard(stack, n)
    workers = range(n)
    links = [stack.enter_context(closing(FlightLink(0, piped_address, w, 20.0))) for w in workers]
    refs = [stack.enter_context(closing(FlightLink(0, whole_address, w, 20.0))) for w in workers]
    last = n - 1
    for step in range(2):
        grads = [_grads(step, w) for w in workers]
        into = [{k: np.full_like(v, np.nan) for k, v in _initial().items()} for _ in workers]
        streams = [_stream(links[w], step, into[w]) for w in workers]
        for w in range(last):
            _write(streams[w], grads[w], KEYS)
        _write(streams[last], grads[last], ("a",))
        streams[0].read_reply()
        # The last worker has not sent "b" yet: the round is open, yet "a"'s next value is here.
        deadline = time.monotonic() + 20
        while np.isnan(into[0]["a"]).any() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not np.isnan(into[0]["a"]).any(), "no value of 'a' before the round closed"
        assert piped.status().clock == step  # the round has not closed
        assert np.isnan(into[0]["b"]).all()  # not predictable yet
        _write(streams[last], grads[last], ("b", "c"))
        with ThreadPoolExecutor(2 * n) as pool:
            ended = [pool.submit(s.end) for s in streams]
            sent = [pool.submit(refs[w].push_pull, step, grads[w]) for w in workers]
            results = [f.result(timeout=60) for f in ended]
            expected = [f.result(timeout=60) for f in sent]
        for (pushed, arrays), (ref_pushed, ref_arrays) in zip(results, expected, strict=True):
            assert pushed.applied and ref_pushed.applied
            for k in KEYS:
                assert arrays[k].tobytes() == ref_arrays[k].tobytes(), (step, k)
        for w in workers:
            for k in KEYS:
                assert into[w][k].tobytes() == expected[w][1][k].tobytes()
    assert (piped.predicted_rounds, whole.predicted_rounds) == (2, 0)  # installed, not redone
    assert (_replies(piped, "held"), _replies(piped, "resent")) == (2.0 * n, 0.0)
    held, ref = piped.snapshot(), whole.snapshot()
    assert all(held[k].tobytes() == ref[k].tobytes() for k in KEYS)
    momentum = piped.optimizer_state()
    ref_momentum = whole.optimizer_state()
    for k in KEYS:
        for slot, value in ref_momentum[k].items():
            assert np.asarray(momentum[k][slot]).tobytes() == np.asarray(value).tobytes()


def test_a_prediction_that_cannot_hold_is_refused_and_the_step_sent_again_gets_the_round(
    stack: ExitStack,
) -> None:
    shard, address = _shard(stack, 2)
    links = [stack.enter_context(closing(FlightLink(0, address, w, 20.0))) for w in (0, 1)]
    grads = [_grads(0, w) for w in (0, 1)]
    with ThreadPoolExecutor(1) as pool:
        # Worker 1's push, sent whole before any preview exists, feeds none: the preview
        # worker 0's stream starts can never be complete.
        first = pool.submit(links[1].push_pull, 0, grads[1])
        deadline = time.monotonic() + 20
        while shard.status().pushes_applied < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        into = {k: np.zeros_like(v) for k, v in _initial().items()}
        stream = _stream(links[0], 0, into)
        _write(stream, grads[0], KEYS)
        with pytest.raises(UnavailableError, match="not those the step left"):
            stream.end()
        _, expected = first.result(timeout=60)
    held = shard.snapshot()
    assert all(held[k].tobytes() == expected[k].tobytes() for k in KEYS)  # applied once
    assert shard.predicted_rounds == 0
    assert (_replies(shard, "held"), _replies(shard, "resent")) == (0.0, 1.0)
    pushed, arrays = links[0].push_pull(0, grads[0])
    assert (pushed.applied, pushed.reason) == (False, "duplicate")
    assert all(arrays[k].tobytes() == expected[k].tobytes() for k in KEYS)


def test_a_refused_gradient_mid_stream_changes_nothing(stack: ExitStack) -> None:
    shard, address = _shard(stack, 1)
    link = stack.enter_context(closing(FlightLink(0, address, 0, 20.0)))
    grads = _grads(0, 0)
    grads["b"][5] = np.nan
    before = shard.snapshot()
    stream = _stream(link, 0, {k: np.zeros_like(v) for k, v in _initial().items()})
    with pytest.raises(InvalidRequestError, match="'b'"):
        _write(stream, grads, KEYS)
        stream.end()
    after = shard.snapshot()
    assert all(after[k].tobytes() == before[k].tobytes() for k in KEYS)
    assert shard.status().pushes_applied == 0


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert all(a[k].tobytes() == b[k].tobytes() for k in KEYS), [
        k for k in KEYS if a[k].tobytes() != b[k].tobytes()
    ]


@pytest.fixture
def patient_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """An async push's preview waits 30 s, not 2, for the one begun before it (and is made
    after one silent that long): a loaded machine must not turn the order these tests set
    into a stall."""
    monkeypatch.setattr(pipeline, "CHAIN_WAIT_S", 30.0)
    monkeypatch.setattr(shard_module, "CHAIN_WAIT_S", 30.0)


@pytest.mark.usefixtures("patient_chain")
def test_async_pushes_streaming_at_once_are_predicted_each_after_the_one_begun_before(
    stack: ExitStack,
) -> None:
    # Two async workers' pushes stream at the same time, worker 1's begun after worker 0's:
    # each reply streams back before its push has all arrived, worker 1's predicted from
    # worker 0's predictions, and every value is what a shard applying the same pushes whole,
    # in that order, leaves (momentum too), over two steps.
    piped, piped_address = _shard(stack, 2, "async")
    whole, whole_address = _shard(stack, 2, "async")
    links = [stack.enter_context(closing(FlightLink(0, piped_address, w, 20.0))) for w in (0, 1)]
    refs = [stack.enter_context(closing(FlightLink(0, whole_address, w, 20.0))) for w in (0, 1)]
    for step in range(2):
        grads = [_grads(step, w) for w in (0, 1)]
        into = [{k: np.full_like(v, np.nan) for k, v in _initial().items()} for _ in (0, 1)]
        streams = []
        for w in (0, 1):  # worker 1's push begins once the shard has worker 0's
            streams.append(_stream(links[w], step, into[w]))
            _write(streams[w], grads[w], ("a",))
            streams[w].read_reply()
            deadline = time.monotonic() + 20
            while np.isnan(into[w]["a"]).any() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not np.isnan(into[w]["a"]).any(), "no value of 'a' before the pushes ended"
        assert piped.status().pushes_applied == 2 * step  # neither push applied yet
        for w in (0, 1):
            _write(streams[w], grads[w], ("b", "c"))
        with ThreadPoolExecutor(2) as pool:
            ended = [pool.submit(s.end) for s in streams]
            results = [f.result(timeout=60) for f in ended]
        expected = [refs[w].push_pull(step, grads[w]) for w in (0, 1)]  # in that order
        for (pushed, arrays), (ref_pushed, ref_arrays) in zip(results, expected, strict=True):
            assert pushed.applied and ref_pushed.applied
            _same(arrays, ref_arrays)
        for w in (0, 1):
            _same(into[w], expected[w][1])
    assert (piped.predicted_rounds, whole.predicted_rounds) == (4, 0)  # installed, not redone
    assert (_replies(piped, "held"), _replies(piped, "resent")) == (4.0, 0.0)
    _same(piped.snapshot(), whole.snapshot())
    momentum, ref_momentum = piped.optimizer_state(), whole.optimizer_state()
    for k in KEYS:
        for slot, value in ref_momentum[k].items():
            assert np.asarray(momentum[k][slot]).tobytes() == np.asarray(value).tobytes()


def _joined(shard: Shard, worker: int, step: int) -> None:
    """Waits until ``worker``'s push of ``step`` has its async preview (the shard read its
    header): pushes begun after it are predicted after it."""
    deadline = time.monotonic() + 20
    while shard._chain.of(worker, step) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert shard._chain.of(worker, step) is not None


@pytest.mark.usefixtures("patient_chain")
@pytest.mark.parametrize("fault", ["refused", "whole first"])
def test_an_async_prediction_whose_base_changed_is_refused_and_sent_again(
    stack: ExitStack, fault: str
) -> None:
    # "refused": worker 0's push (begun first) carries a NaN and is refused, so worker 1's
    # prediction, made after it, cannot hold. "whole first": a push sent whole by worker 1
    # is applied while worker 0's streams, so worker 0's prediction cannot hold. Either way
    # the push whose prediction failed is applied once, as it would be whole, its call fails
    # UNAVAILABLE, and its step sent again is a duplicate answered with the shard's values.
    piped, piped_address = _shard(stack, 2, "async")
    whole, whole_address = _shard(stack, 2, "async")
    links = [stack.enter_context(closing(FlightLink(0, piped_address, w, 20.0))) for w in (0, 1)]
    refs = [stack.enter_context(closing(FlightLink(0, whole_address, w, 20.0))) for w in (0, 1)]
    grads = [_grads(0, w) for w in (0, 1)]
    into = {k: np.zeros_like(v) for k, v in _initial().items()}
    if fault == "refused":
        grads[0]["b"][3] = np.nan
        streams = [_stream(links[0], 0, into)]
        _joined(piped, 0, 0)  # worker 1's push is predicted after it
        streams.append(_stream(links[1], 0, into))
        _joined(piped, 1, 0)  # before worker 0's push fails
        _write(streams[1], grads[1], KEYS)
        with pytest.raises(InvalidRequestError, match="'b'"):
            _write(streams[0], grads[0], KEYS)
            streams[0].end()
        victim, applied = 1, [1]
    else:
        victim_stream = _stream(links[0], 0, into)
        _joined(piped, 0, 0)  # predicted before the push sent whole lands
        _write(victim_stream, grads[0], ("a",))
        assert links[1].push_pull(0, grads[1])[0].applied
        _write(victim_stream, grads[0], ("b", "c"))
        streams = [victim_stream]
        victim, applied = 0, [1, 0]
    with pytest.raises(UnavailableError, match="not those the step left"):
        streams[-1].end()
    for w in applied:
        refs[w].push_pull(0, grads[w])
    _same(piped.snapshot(), whole.snapshot())  # each push applied once, in arrival order
    assert piped.status().pushes_applied == len(applied)
    assert (_replies(piped, "held"), _replies(piped, "resent")) == (0.0, 1.0)
    pushed, arrays = links[victim].push_pull(0, grads[victim])
    assert (pushed.applied, pushed.reason) == (False, "duplicate")
    _same(arrays, whole.snapshot())


def _rpcs(shard: Shard, method: str, code: str) -> float:
    labels = {"shard": "ps0", "rpc": method, "code": code}
    metrics: ShardMetrics = shard.metrics  # type: ignore[attr-defined]
    return metrics.registry.get_sample_value("psserver_rpcs_total", labels) or 0.0


# Worker 0 in a process of its own: its step 0 (whole or streamed), which waits for the round.
_WORKER_0 = """
import sys
import numpy as np
from pswire import flightwire as fw
from psworker.flight_link import FlightLink
n, streamed, address = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
grads = {"a": np.ones(n, np.float32), "b": np.ones(n, np.float32), "c": np.ones(8, np.float32)}
link = FlightLink(0, address, 0, 20.0)
if streamed:
    into = {k: np.zeros_like(v) for k, v in grads.items()}
    entries = [fw.manifest_entry(k, "float32", v.shape) for k, v in grads.items()]
    stream = link.begin_stream(0, entries, into)
    stream.write([fw.encode_tensor(k, v)[1] for k, v in grads.items()])
    stream.end()
else:
    link.push_pull(0, grads)
"""


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "pipelined"])
def test_a_step_whose_worker_was_killed_stops_waiting_for_its_round(
    stack: ExitStack, streamed: bool
) -> None:
    # Worker 0's step waits for worker 1's push, which never comes, and worker 0 is killed.
    # The shard's call gives up within a second or so, not at the step's 20 s deadline,
    # holding neither a thread nor the push's bytes meanwhile.
    shard, address = _shard(stack, 2)
    args = [sys.executable, "-c", _WORKER_0, str(N), "1" if streamed else "0", address]
    worker = subprocess.Popen(args, cwd=REPO)
    stack.callback(worker.wait, timeout=10)
    stack.callback(worker.kill)
    deadline = time.monotonic() + 60
    while shard.status().pushes_applied < 1 and time.monotonic() < deadline:
        assert worker.poll() is None
        time.sleep(0.01)
    assert shard.status().pushes_applied == 1  # taken into the round, which waits
    worker.kill()
    worker.wait(timeout=10)
    gone = time.monotonic()
    method = "PushPullStreamed" if streamed else "PushPull"
    while _rpcs(shard, method, "CANCELLED") < 1 and time.monotonic() - gone < 15:
        time.sleep(0.05)
    assert _rpcs(shard, method, "CANCELLED") == 1, time.monotonic() - gone
