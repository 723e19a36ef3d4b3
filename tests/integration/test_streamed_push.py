"""DistributedOptimizer(overlap=True) with steps on the Flight data port: each shard's push
streams from backward's hooks (psworker/push_stream.py). The results are the serial step's bit
for bit; a stream cancelled before its last tensor (a clip, a NaN, an unused parameter, a
stall past its deadline, a shard restarted mid-stream) leaves every shard as it was, and the
step is refused or sent whole; the data port's guarantees hold on the stream."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from faults import FaultPlan, flight_faults  # noqa: E402
from states import assert_identical  # noqa: E402
from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from psserver.records import Limits  # noqa: E402
from psserver.server import RunningServer, start_server  # noqa: E402
from psserver.shard import Shard  # noqa: E402
from pswire import flightwire as fw  # noqa: E402
from pswire.errors import (  # noqa: E402
    ConfigError,
    InvalidRequestError,
    ShardBusyError,
    TooLargeError,
)
from psworker import flight_link  # noqa: E402
from psworker.torch import DistributedOptimizer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STEPS, BATCH = 6, 8
# A hook before forward or between backward() and step(): (step, worker, model, optimizer,
# servers).
Between = Callable[[int, int, Any, DistributedOptimizer, list[RunningServer]], None]


@pytest.fixture(autouse=True)
def flight_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These small models' steps on the data port too (by default they go on grpcio)."""
    monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "0")


@pytest.fixture(params=["read-at-step", "read-early"])
def reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """When a streamed step's reply is read: from step() on (these small steps' links are
    never behind backward), or from the stream's start, into staging arrays, as on a link
    slower than backward (``FlightLink.behind``): the faults below hit either way."""
    if request.param == "read-early":
        monkeypatch.setattr(flight_link, "_EARLY_BEHIND", -1.0)
    return str(request.param)


@pytest.fixture
def servers() -> Iterator[Callable[..., list[RunningServer]]]:
    started: list[RunningServer] = []

    def make(n: int = 2, checkpointing: bool = False, **options: Any) -> list[RunningServer]:
        made = []
        for _ in range(n):
            shard = Shard(Limits(max_wait_s=10.0))
            shard.checkpointing = checkpointing  # workers then keep a replay log
            made.append(start_server(shard, **options))
        started.extend(made)
        return made

    yield make
    for server in started:
        server.stop(grace=0.5)


class Net(torch.nn.Module):
    """Conv, BatchNorm (buffers ride at the end of each shard's push), linear layers,
    ``extra``, a branch only odd steps use (its gradients are None on even steps), and
    ``side``, whose weight forward reads outside its module."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc1 = torch.nn.Linear(4 * 8 * 8, 32)
        self.fc2 = torch.nn.Linear(32, 10)
        self.extra = torch.nn.Linear(32, 1, bias=False)  # on one shard: its output broadcast
        # Never called: its weight is read by forward below, outside its own module (a tied
        # weight used functionally): it must have landed all the same.
        self.side = torch.nn.Linear(32, 10, bias=False)
        self.use_extra = False
        self.poisoned = False  # a NaN input: every gradient NaN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.poisoned:
            x = x * float("nan")
        h = torch.relu(self.fc1(torch.relu(self.bn(self.conv(x))).flatten(1)))
        out = self.fc2(h) + torch.nn.functional.linear(h, self.side.weight)
        return out + self.extra(h) if self.use_extra else out


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(
    servers: list[RunningServer],
    mode: str,
    workers: int,
    overlap: bool,
    between: Between | None = None,
    extra_on_odd: bool = False,
    before: Between | None = None,
    set_to_none: bool = True,
    **connect: Any,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, DistributedOptimizer]]:
    """Each worker's final state_dict (and optimizer) after STEPS steps on its own slice."""
    x, y = data(STEPS * workers * BATCH)
    states: dict[int, dict[str, torch.Tensor]] = {}
    opts: dict[int, DistributedOptimizer] = {}
    models = {i: Net(i) for i in range(workers)}  # built here: torch's RNG is not for threads
    addrs = [s.address for s in servers]
    connect.setdefault("split_bytes", 1024)  # fc1.weight (8 KiB) split over both shards

    def worker(i: int) -> Callable[[], None]:
        def run() -> None:
            model = models[i]
            with psworker.connect(
                addrs, worker_id=i, num_workers=workers, mode=mode, **connect
            ) as client:
                inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                opt = DistributedOptimizer(model, client, inner, overlap=overlap)
                opts[i] = opt
                for t in range(STEPS):
                    a = (t * workers + i) * BATCH
                    model.use_extra = extra_on_odd and t % 2 == 1
                    opt.zero_grad(set_to_none)
                    if before is not None:
                        before(t, i, model, opt, servers)
                    loss = torch.nn.functional.cross_entropy(
                        model(x[a : a + BATCH]), y[a : a + BATCH]
                    )
                    loss.backward()
                    if between is not None:
                        between(t, i, model, opt, servers)
                    opt.step()
                states[i] = {k: v.clone() for k, v in model.state_dict().items()}

        return run

    run_workers([worker(i) for i in range(workers)])
    return states, opts


def shard_state(server: RunningServer) -> tuple:
    st = server.shard.status()
    return {k: v.tobytes() for k, v in server.shard.snapshot().items()}, st.clock, st.pushes_applied


def wait_for(what: str, condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"waited {within}s for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize(("mode", "workers"), [("sync", 2), ("sync", 3), ("async", 1), ("ssp", 1)])
def test_streamed_pushes_give_the_serial_steps_results_bit_for_bit(servers, mode, workers):
    # sync with 3 workers: streamed pushes are read as they arrive, not on their turn, and
    # the round still sums them in worker order.
    serial, _ = train(servers(2), mode, workers, overlap=False)
    running = servers(2)
    streamed, opts = train(running, mode, workers, overlap=True)
    for i in range(workers):
        overlap = opts[i]._overlap
        assert overlap is not None and overlap.armed
        # Every step after the first (serial, to arm) streamed to both shards.
        assert overlap.streamed == 2 * (STEPS - 1)
        assert_identical(serial[i], streamed[i])
    # sync and async: each of those steps' replies was predicted, and installed as the step,
    # on the shard whose every variable each push carries (the other holds the branch only
    # odd steps use: a push without it is answered whole).
    predicted = 0 if mode == "ssp" else (STEPS - 1) * (workers if mode == "async" else 1)
    assert [s.shard.predicted_rounds for s in running] == [predicted, 0]


@pytest.mark.parametrize(("mode", "workers"), [("sync", 2), ("async", 1)])
def test_variables_cut_into_more_parts_than_shards_stream_to_the_serial_steps_bits(
    servers, mode, workers
):
    # part_bytes=2048: fc1.weight (32 KiB) in 16 parts, 8 on each shard, each predicted and
    # written back on its own. The serial steps keep the default placement (no variable here
    # is above 1 MiB): how variables are cut changes no bit either.
    serial, _ = train(servers(2), mode, workers, overlap=False)
    running = servers(2)
    streamed, opts = train(running, mode, workers, overlap=True, part_bytes=2048)
    parts = opts[0].client.shard_map.pieces_of("fc1.weight")
    assert [p.key for p in parts] == [f"fc1.weight/part{i}of16" for i in range(16)]
    assert sorted(p.shard for p in parts) == [0] * 8 + [1] * 8
    for i in range(workers):
        overlap = opts[i]._overlap
        assert overlap is not None and overlap.streamed == 2 * (STEPS - 1)
        assert_identical(serial[i], streamed[i])
    # Every streamed step's reply predicted and installed on a shard whose every part each
    # push carries (the branch only odd steps use sits on one shard).
    predicted = (STEPS - 1) * (workers if mode == "async" else 1)
    assert sum(s.shard.predicted_rounds for s in running) >= predicted


@pytest.mark.parametrize("data_plane", ["flight", "flight-step", "grpc"], indirect=True)
def test_overlap_gives_the_serial_steps_results_whichever_way_the_steps_travel(servers, data_plane):
    # conftest.py's data_plane: record batches on the data port at every size (streamed
    # from backward); the default size rule (these small steps go whole, in one message each
    # way on the data port's step exchange, never streamed); grpcio (no data port).
    serial, _ = train(servers(2), "sync", 2, overlap=False)
    streamed, opts = train(servers(2), "sync", 2, overlap=True)
    for i in range(2):
        overlap = opts[i]._overlap
        assert overlap is not None and overlap.armed
        assert overlap.streamed == (2 * (STEPS - 1) if data_plane == "flight" else 0)
        assert [link.steps.name for link in opts[i].client.links] == [data_plane] * 2
        assert_identical(serial[i], streamed[i])


@pytest.mark.parametrize("data_plane", ["flight", "flight-step"], indirect=True)
@pytest.mark.parametrize("action", ["drop", "lose_reply"])
def test_a_streamed_step_whose_header_or_reply_is_lost_is_sent_whole_and_applied_once(
    servers, action, data_plane, reading
):
    # Worker 0's data-port steps counted together over both shards: 1-2 are the serial first
    # step's, 3-4 its first overlapped step's (one per shard): streams on record batches,
    # small steps on the step exchange under the default size rule (the faults reach both).
    plan = FaultPlan("PushPullStream", {3, 4}, action)

    def faults(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        if t == 0 and i == 0:
            flight_faults(opt.client, [plan])

    serial, _ = train(servers(2), "sync", 2, overlap=False)
    streamed, opts = train(servers(2), "sync", 2, overlap=True, before=faults)
    assert plan.fired == 2
    overlap = opts[0]._overlap
    streams = data_plane == "flight"
    assert overlap is not None and overlap.streamed == (2 * (STEPS - 1) if streams else 0)
    assert [link.steps.name for link in opts[0].client.links] == [data_plane] * 2
    # "drop": the stream never opened and its thread sent the step whole at step() (a small
    # step: never sent, sent again); "lose_reply": the shard applied the step, its reply was
    # lost, and the step sent again whole was answered as a duplicate. Either way each step
    # applied once, as serially.
    for i in range(2):
        assert_identical(serial[i], streamed[i])


class _Pause(torch.autograd.Function):
    """Identity whose backward sleeps: backward stops here long enough for the reply of the
    gradients before it to arrive."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class ReadsBack(torch.nn.Module):
    """A first layer whose backward reads ``fc2.weight`` after fc2's own gradient is made:
    the input is scaled by a view of that weight outside autograd (``detach``), saved for
    backward in the parameter's memory. Backward pauses just after fc2's gradient left."""

    def __init__(self, seed: int, pause: float) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = torch.nn.Linear(4 * 8 * 8, 32)
        self.fc2 = torch.nn.Linear(32, 10)
        self.pause = pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x) * self.fc2.weight.detach()[0, 0]
        h = torch.relu(self.fc1(_Pause.apply(h, self.pause).flatten(1)))
        return self.fc2(h)


def test_a_reply_arriving_during_backward_waits_until_backward_is_over(servers):
    # The reply is read while backward runs (its download beside the upload, as on a link
    # slower than backward: ``behind``): fc2's next weight arrives during the pause, before
    # the first layer's backward reads fc2's weight. Landing in the parameter then would
    # change the first layer's gradient (autograd's version check does not see a write into
    # the memory): it waits in the link's staging arrays until backward is over.
    x, y = data(STEPS * BATCH)
    results = {}
    for overlap in (False, True):
        made = servers(2)
        # The pause changes no value (the serial run needs none): long enough for fc2's reply
        # to arrive on a loaded machine.
        model = ReadsBack(0, pause=1.0 if overlap else 0.0)
        with psworker.connect([s.address for s in made], worker_id=0, num_workers=1) as client:
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            opt = DistributedOptimizer(model, client, inner, overlap=overlap)
            for t in range(STEPS):
                for link in client.links:
                    assert link.flight is not None
                    link.flight.link.behind = 1.0  # every reply read from its start
                opt.zero_grad()
                a = t * BATCH
                torch.nn.functional.cross_entropy(
                    model(x[a : a + BATCH]), y[a : a + BATCH]
                ).backward()
                opt.step()
            results[overlap] = {k: v.clone() for k, v in model.state_dict().items()}
            if overlap:
                assert opt._overlap is not None and opt._overlap.streamed == 2 * (STEPS - 1)
                staged = [
                    link.flight.link.staging for link in client.links if link.flight is not None
                ]
    assert_identical(results[False], results[True])
    # fc2's weight went through the staging arrays of the shard that holds it.
    assert any("fc2.weight" in s for s in staged), staged


def test_a_link_behind_backward_reads_its_next_reply_from_the_start(servers):
    """``FlightLink.behind``: the share of a streamed step's bytes still unwritten when
    backward ended (``read_reply``), its last tensor aside (held until then); over a quarter,
    the next stream's reply is read from its start into staging arrays."""
    (server,) = servers(1)
    n = 25_000
    values = {k: np.zeros(n, np.float32) for k in "abc"}
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init(values, psworker.SGD(lr=0.1))
        flight = c.links[0].flight
        assert flight is not None
        link = flight.link
        entries = [fw.manifest_entry(k, "float32", (n,)) for k in values]
        into = {k: np.zeros(n, np.float32) for k in values}
        grad = fw.encode_tensor("a", np.ones(n, np.float32))[1]

        def step(written: int) -> Any:
            stream = link.begin_stream(0, entries, into, c.links[0].incarnation or "")
            for k in "abc"[:written]:
                stream.write([fw.encode_tensor(k, np.ones(n, np.float32))[1]])
            stream.read_reply()  # backward is over
            return stream

        first = step(written=1)  # "b" still to write: a third of the bytes
        assert first._staged is None and link.behind == pytest.approx(1 / 3)
        first.close()
        second = step(written=2)  # all but the held last tensor went before backward ended
        assert second._staged is not None and link.behind == 0.0
        second.close()
        third = link.begin_stream(0, entries, into, c.links[0].incarnation or "")
        assert third._staged is None
        third.write([grad])
        third.close()
    assert server.shard.status().pushes_applied == 0  # every stream was cut: nothing applied


def test_zeroing_gradients_in_place_waits_for_the_pushes_still_sending_them(servers):
    # zero_grad(set_to_none=False) zeroes the very memory a stream may still be writing.
    serial, _ = train(servers(2), "sync", 1, overlap=False, set_to_none=False)
    streamed, opts = train(servers(2), "sync", 1, overlap=True, set_to_none=False)
    overlap = opts[0]._overlap
    assert overlap is not None and overlap.streamed == 2 * (STEPS - 1)
    assert_identical(serial[0], streamed[0])


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_gradients_stream_in_their_wire_dtype(servers, compression):
    serial, _ = train(servers(2), "sync", 1, overlap=False, compression=compression)
    streamed, opts = train(servers(2), "sync", 1, overlap=True, compression=compression)
    overlap = opts[0]._overlap
    assert overlap is not None and overlap.streamed == 2 * (STEPS - 1)  # manifests matched
    assert_identical(serial[0], streamed[0])


def test_a_parameter_unused_on_some_steps_sends_its_shards_step_whole(servers):
    serial, _ = train(servers(2), "sync", 1, overlap=False, extra_on_odd=True)
    streamed, opts = train(servers(2), "sync", 1, overlap=True, extra_on_odd=True)
    overlap = opts[0]._overlap
    assert overlap is not None
    # The shard holding ``extra`` gets another set of gradients than the last step's on every
    # step after the first: its streams are cancelled and its steps sent whole; the other
    # shard's stream.
    assert 0 < overlap.streamed < 2 * (STEPS - 1)
    assert_identical(serial[0], streamed[0])


def test_a_clip_after_the_gradients_left_is_refused_and_no_shard_applies_the_step(servers):
    made = servers(2)
    seen: dict[str, Any] = {}

    def clip(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        if t == 3:
            seen["before"] = [shard_state(s) for s in held]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: overlap armed on step 0
        with pytest.raises(ConfigError, match=r"overlap=True the gradients of \[.*changed"):
            train(made, "sync", 1, overlap=True, between=clip)
    # The client is closed: every stream of step 3 ended, none was whole.
    assert [shard_state(s) for s in made] == seen["before"]
    assert all(s.shard.status().clock == 3 for s in made)


def test_a_nan_gradient_is_refused_before_any_shard_has_it_whole(servers):
    made = servers(2)
    seen: dict[str, Any] = {}

    def poison(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        model.poisoned = t == 2

    def look(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        if t == 2:  # step 1 landed when step 2's first gradient came
            seen["before"] = [shard_state(s) for s in held]

    with pytest.raises(InvalidRequestError, match="NaN or Inf"):
        train(made, "async", 1, overlap=True, before=poison, between=look)
    assert [shard_state(s) for s in made] == seen["before"]
    assert all(s.shard.status().clock == 2 for s in made)


def test_a_stream_stalled_past_its_deadline_frees_the_shard_and_the_step_goes_whole(
    servers, reading
):
    serial, _ = train(servers(2), "async", 1, overlap=False)
    made = servers(2)
    seen: dict[str, Any] = {}

    def stall(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        if t != 3:
            return
        # Every gradient but the last is on its way: the shards hold those bytes...
        admissions = [s.admission for s in held]
        assert all(a is not None for a in admissions)
        wait_for("the streams' bytes", lambda: all(a.inflight_bytes > 0 for a in admissions))
        seen["before"] = [shard_state(s) for s in held]
        started = time.monotonic()
        # ...until the stream's deadline (the client's timeout, 2 s) ends both calls, though
        # this worker neither writes nor cancels anything meanwhile.
        wait_for("the deadline", lambda: all(a.inflight_bytes == 0 for a in admissions), 10.0)
        seen["freed_after"] = time.monotonic() - started
        assert [shard_state(s) for s in held] == seen["before"]

    streamed, opts = train(made, "async", 1, overlap=True, between=stall, timeout=2.0)
    assert seen["freed_after"] < 4.0
    overlap = opts[0]._overlap
    assert overlap is not None and overlap.streamed == 2 * (STEPS - 2)  # step 3 went whole
    assert_identical(serial[0], streamed[0])


def test_a_stream_the_worker_stops_writing_ends_at_its_deadline_on_the_shard(servers):
    """The shard's side alone: a worker that sends a header and one tensor, then nothing
    (paused, or hostile), holds the shard's call and bytes only until the deadline."""
    (server,) = servers(1)
    values = {"a": np.zeros(1000, np.float32), "b": np.zeros(1000, np.float32)}
    with psworker.connect([server.address], worker_id=0, num_workers=1, timeout=1.5) as c:
        c.init(values, psworker.SGD(lr=0.1))
        before = shard_state(server)
        link = c.links[0]
        assert link.flight is not None
        entries = [fw.manifest_entry(k, "float32", (1000,)) for k in values]
        stream = link.flight.link.begin_stream(0, entries, None, link.incarnation or "")
        stream.write([fw.encode_tensor("a", np.ones(1000, np.float32))[1]])
        admission = server.admission
        assert admission is not None
        wait_for("the first tensor", lambda: admission.inflight_bytes == 4000)
        started = time.monotonic()
        wait_for("the deadline", lambda: admission.inflight_bytes == 0)
        assert time.monotonic() - started < 3.0
        assert shard_state(server) == before
        stream.close()
        c.push_pull({"a": np.ones(1000, np.float32)})  # the shard still serves
        assert server.shard.status().pushes_applied == before[2] + 1


def test_a_shard_restarted_mid_stream_gets_the_lost_steps_replayed(servers, reading):
    serial, _ = train(servers(2), "async", 1, overlap=False)
    made = servers(2, checkpointing=True)
    saved: dict[str, Any] = {}

    def restart(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        shard = held[0].shard
        if t == 1:  # a checkpoint of step 1's start: steps 1-2 live in the replay log
            saved["state"] = shard.export_state()
            shard.mark_checkpoint(saved["state"])
        if t == 3:  # shard 0's stream of step 3 is open, its last tensor held: kill -9 it
            port = held[0].port
            held[0].stop(grace=0)
            fresh = Shard(Limits(max_wait_s=10.0))
            fresh.checkpointing = True
            fresh.restore(saved["state"])
            held[0] = start_server(fresh, port=port)

    streamed, opts = train(made, "async", 1, overlap=True, between=restart)
    link = opts[0].client.links[0]  # type: ignore[attr-defined]
    assert link.recoveries == 1
    assert made[0].shard.status().clock == STEPS
    assert_identical(serial[0], streamed[0])
    made[0].stop(grace=0.5)


def test_a_streamed_push_over_the_byte_limit_is_refused_from_its_manifest(servers):
    # Init's values travel on the control port; a step's 9 KiB push is over 8 KiB.
    limits = Limits(max_wait_s=5.0, max_request_bytes=8 << 10)
    made = []
    for _ in range(2):
        made.append(start_server(Shard(limits)))
    try:
        with pytest.raises(TooLargeError, match="over the limit of 8192"):
            train(made, "async", 1, overlap=True, split_bytes=1 << 30)
    finally:
        for s in made:
            s.stop(grace=0.5)


def test_a_busy_shard_gets_the_step_whole_instead_of_the_stream(servers):
    """--max-inflight-bytes: a stream holds its bytes through backward; one that would pass
    the limit is refused (nothing applied), and the step is sent whole when step() comes."""
    serial, _ = train(servers(2), "async", 1, overlap=False)
    made = servers(2, max_inflight_bytes=1 << 20)
    admissions = [s.admission for s in made]
    refused = [threading.Event() for _ in made]
    hogs: list[contextlib.ExitStack] = []
    for admission, said in zip(admissions, refused, strict=True):
        assert admission is not None
        original = admission.inflight

        @contextlib.contextmanager
        def watched(original=original, said=said) -> Iterator[Callable[[int], None]]:
            with original() as reserve:

                def counted(nbytes: int) -> None:
                    try:
                        reserve(nbytes)
                    except ShardBusyError:
                        said.set()
                        raise

                yield counted

        admission.inflight = watched  # type: ignore[method-assign]

    def hog(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        if t == 2:  # another request holds the whole limit while step 2 streams
            opt.synchronize()  # step 1 is read and applied: its bytes are free
            for admission in admissions:
                assert admission is not None
                stack = contextlib.ExitStack()
                stack.enter_context(admission.inflight())(1 << 20)
                hogs.append(stack)

    def release(t: int, i: int, model: Any, opt: DistributedOptimizer, held: list) -> None:
        if t == 2:
            for said in refused:
                wait_for("the stream's refusal", said.is_set)
            for stack in hogs:
                stack.close()

    streamed, opts = train(made, "async", 1, overlap=True, before=hog, between=release)
    overlap = opts[0]._overlap
    assert overlap is not None and overlap.streamed == 2 * (STEPS - 1)
    assert_identical(serial[0], streamed[0])


def test_the_token_and_mutual_tls_guard_the_streamed_push(servers, tmp_path):
    from psctl.certs import write_certs
    from pswire.security import ServerSecurity

    token = "streamed-push_t0ken"
    certs = write_certs(tmp_path, ["127.0.0.1", "localhost"])
    security = ServerSecurity(
        cert=certs.server_cert, key=certs.server_key, ca=certs.ca, token=token
    )
    tls = {"tls_ca": certs.ca, "tls_cert": certs.client_cert, "tls_key": certs.client_key}
    serial, _ = train(servers(2), "sync", 1, overlap=False)
    streamed, opts = train(
        servers(2, security=security), "sync", 1, overlap=True, token=token, **tls
    )
    overlap = opts[0]._overlap
    assert overlap is not None and overlap.streamed == 2 * (STEPS - 1)
    assert_identical(serial[0], streamed[0])
