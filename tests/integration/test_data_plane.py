"""The transport seam switched on: a shard serves its Flight data port by default, workers learn
it from RegisterWorker and move every tensor byte over it, falling back to grpcio where a shard
has none; the data port keeps the control port's guarantees (token, limits, bad input refused
with state unchanged), also against a raw pyarrow.flight client sending garbage."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.flight as flight
import pytest

import psworker
from pscore.tables import RowSparse, Table
from psserver.config import parse_config
from psserver.flight_service import STEP_FRAMING_BYTES
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire import flightwire as fw
from pswire import write
from pswire.errors import (
    ConfigError,
    InvalidRequestError,
    PSError,
    ShardBusyError,
    TooLargeError,
)
from pswire.proto import ps_pb2

pytestmark = pytest.mark.timeout(60)
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(3, np.float32)}
GRAD = {"w": np.ones((4, 3), np.float32), "b": np.full(3, 2.0, np.float32)}
TOKEN = "data-plane_t0ken.for.tests"
SGD = psworker.SGD(lr=0.5)


@pytest.fixture(autouse=True)
def flight_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These small steps on the data port too (by default they would travel on grpcio)."""
    monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "0")


@pytest.fixture
def servers() -> Iterator[Callable[..., RunningServer]]:
    started: list[RunningServer] = []

    def make(**options: Any) -> RunningServer:
        options.setdefault("shard", Shard(Limits(max_wait_s=5.0)))
        server = start_server(**options)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop(grace=0.5)


def train(addresses: list[str], steps: int, mode: str = "async", **options: Any) -> tuple:
    """(the weights after ``steps`` push_pulls, each link's transport name)."""
    with psworker.connect(addresses, worker_id=0, num_workers=1, mode=mode, **options) as c:
        c.init(MODEL, psworker.SGD(lr=0.5, momentum=0.9))
        out = {}
        for step in range(steps):
            out = c.push_pull({k: v * (step + 1) for k, v in GRAD.items()})
        names = [link.steps.name for link in c.links]
        return {k: v.copy() for k, v in out.items()}, names


def test_workers_train_over_the_data_port_and_match_grpcio_bit_for_bit(servers) -> None:
    flight_servers = [servers(), servers()]
    assert all(s.data_port for s in flight_servers)
    grpc_servers = [servers(data_port=None), servers(data_port=None)]
    assert not any(s.data_port for s in grpc_servers)
    on_flight, names = train([s.address for s in flight_servers], 4, split_bytes=16)
    assert names == ["flight", "flight"]
    on_grpc, names = train([s.address for s in grpc_servers], 4, split_bytes=16)
    assert names == ["grpc", "grpc"]  # no data port: the worker falls back to grpcio
    for k in MODEL:
        assert on_flight[k].tobytes() == on_grpc[k].tobytes()


def test_the_data_port_is_in_registration_and_status(servers) -> None:
    server = servers()
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init(MODEL, psworker.SGD(lr=0.5))
        link = c.links[0]
        assert link.data_port == server.data_port > 0
        assert link.flight is not None and link.flight.address.endswith(f":{server.data_port}")
        assert c.status()[0].data_port == server.data_port


def test_steps_under_the_size_rule_travel_in_one_message_and_larger_ones_in_batches(
    servers, monkeypatch
) -> None:
    monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "1024")
    server = servers()
    model = {"small": np.zeros(16, np.float32), "big": np.zeros(512, np.float32)}
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init(model, SGD)
        c.push_pull({"small": np.ones(16, np.float32)})  # 64 bytes out; what comes back?
        assert c.links[0].steps.name == "flight-step"  # one message each way, data port
        first = c.pull()
        c.push_pull({"small": np.ones(16, np.float32)})  # the last reply was 2,112 bytes
        assert c.links[0].steps.name == "flight"  # record batches
        out = {"small": np.zeros(16, np.float32), "big": np.zeros(512, np.float32)}
        c.push({"small": np.ones(16, np.float32)})
        c.push_pull({"small": np.ones(16, np.float32)}, out=out)
        assert c.links[0].steps.name == "flight"
        np.testing.assert_array_equal(first["small"], np.full(16, -0.5, np.float32))
        np.testing.assert_array_equal(out["small"], np.full(16, -2.0, np.float32))
    monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "4096")
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init(model, SGD)
        c.push_pull({"small": np.ones(16, np.float32)})
        assert c.links[0].steps.name == "flight-step"
    monkeypatch.setenv("PS_DATA_PLANE", "grpc")  # tensors kept off the data port: grpcio's
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:  # step stream
        c.init(model, SGD)
        c.push_pull({"small": np.ones(16, np.float32)})
        assert c.links[0].steps.name == "grpc"
    monkeypatch.delenv("PS_DATA_PLANE")
    monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "lots")
    with pytest.raises(ConfigError, match="PS_GRPC_BELOW_BYTES"):
        psworker.connect([server.address], worker_id=0, num_workers=1)


def test_psserver_data_port_flag_and_variable(monkeypatch) -> None:
    assert parse_config([]).data_port == 0
    assert parse_config(["--data-port", "off"]).data_port is None
    assert parse_config(["--data-port", "7101", "--port", "7100"]).data_port == 7101
    monkeypatch.setenv("PS_DATA_PORT", "OFF")
    assert parse_config([]).data_port is None
    monkeypatch.setenv("PS_DATA_PORT", "7100")
    with pytest.raises(SystemExit):  # the same port twice: a usage error naming both
        parse_config(["--port", "7100"])


def test_push_pull_rows_and_pushes_of_tables_travel_on_the_data_port(servers) -> None:
    server = servers()
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init({}, psworker.SGD(lr=1.0), tables={"t": Table(16, 2, init="zeros")})
        ids = np.array([3, 7], np.int64)
        got = c.push_pull({"t": RowSparse(ids, np.ones((2, 2), np.float32))}, rows={"t": ids})
        assert c.links[0].steps.name == "flight"
        np.testing.assert_array_equal(got["t"], -np.ones((2, 2), np.float32))
        c.push({"t": RowSparse(ids[:1], np.ones((1, 2), np.float32))})
        np.testing.assert_array_equal(c.pull_rows("t", ids), [[-2, -2], [-1, -1]])


def test_the_token_guards_the_data_port(servers) -> None:
    from pswire.security import ServerSecurity

    server = servers(security=ServerSecurity(token=TOKEN))
    with psworker.connect([server.address], worker_id=0, num_workers=1, token=TOKEN) as c:
        c.init(MODEL, psworker.SGD(lr=0.5))
        c.push_pull(GRAD)
        assert c.links[0].steps.name == "flight"
    before = state(server)
    client = flight.FlightClient(f"grpc+tcp://127.0.0.1:{server.data_port}")
    try:
        # The refusal may come back while the call is still opening (do_exchange raises) or
        # at the first read: either way it is UNAUTHENTICATED, never an answer.
        with pytest.raises(flight.FlightUnauthenticatedError, match="requires a token"):
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(fw.PUSH_PULL))
            writer.begin(fw.SCHEMA)
            writer.write_metadata(good_header(1))
            reader.read_chunk()
    finally:
        client.close()
    assert state(server) == before


# -- a hostile client on the data port: clear status, nothing changed --------------------------


def state(server: RunningServer) -> tuple:
    st = server.shard.status()
    values = {k: v.tobytes() for k, v in server.shard.snapshot().items()}
    return values, st.clock, st.pushes_applied, st.pushes_duplicate


def good_header(step: int, *entries: Any) -> bytes:
    entries = entries or (ps_pb2.TensorChunk(name="b", dtype="float32", shape=[3], total_bytes=12),)
    head = ps_pb2.PushHeader(worker_id=0, step=step)
    return ps_pb2.PushPullRequest(header=head, chunks=entries).SerializeToString()


def send_raw(port: int, command: bytes, steps: list[tuple[bytes | None, list[bytes]]]) -> Any:
    """Sends hand-made messages on a raw Flight client: each (metadata, batches), the metadata
    riding on the first batch (or alone); returns the error the shard answers (or None)."""
    client = flight.FlightClient(f"grpc+tcp://127.0.0.1:{port}")
    try:
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command))
        writer.begin(fw.SCHEMA)
        for meta, batches in steps:
            if not batches:
                writer.write_metadata(meta)
            for i, raw in enumerate(batches):
                batch = fw.as_batch(np.frombuffer(raw, np.uint8))
                if i == 0 and meta is not None:
                    writer.write_with_metadata(batch, meta)
                else:
                    writer.write_batch(batch)
        writer.done_writing()
        reader.read_chunk()
    except Exception as exc:
        return fw.from_flight_error(exc)
    finally:
        client.close()
    return None


NAN = np.array([1.0, np.nan, 2.0], np.float32).tobytes()
F64 = np.ones(3, np.float64).tobytes()


def step_request(step: int, grads: dict[str, np.ndarray]) -> bytes:
    """A small step (``fw.STEP``): the step stream's own request, tensors inline."""
    return write.request(write.push_header(0, step, "", None, ""), grads, (), 60_000)


NAN_GRAD = {"w": GRAD["w"], "b": np.frombuffer(NAN, np.float32)}
GARBAGE = [
    ("wrong descriptor", b"ps.delete_everything/1", [(good_header(1), [bytes(12)])], "unknown"),
    ("header missing", fw.PUSH_PULL, [(None, [bytes(12)])], "expected a PushPullRequest"),
    ("bytes short", fw.PUSH_PULL, [(good_header(1), [bytes(8)])], "after 8 of 12"),
    ("bytes long", fw.PUSH_PULL, [(good_header(1), [bytes(16)])], "4 bytes left over"),
    (
        "wrong dtype",
        fw.PUSH_PULL,
        [
            (
                good_header(
                    1, ps_pb2.TensorChunk(name="b", dtype="float64", shape=[3], total_bytes=24)
                ),
                [F64],
            )
        ],
        "float64",
    ),
    ("NaN", fw.PUSH_PULL, [(good_header(1), [NAN])], "non-finite"),
    (
        "NaN in the last of two tensors",
        fw.PUSH_PULL,
        [
            (
                good_header(
                    1,
                    ps_pb2.TensorChunk(name="w", dtype="float32", shape=[4, 3], total_bytes=48),
                    ps_pb2.TensorChunk(name="b", dtype="float32", shape=[3], total_bytes=12),
                ),
                [GRAD["w"].tobytes(), NAN],
            )
        ],
        "non-finite",
    ),
    ("garbage header", fw.PUSH, [(b"\x08\xff\xff\xff\xff\xff", [bytes(12)])], "undecodable"),
    ("pull with bytes", fw.PULL, [(ps_pb2.PullRequest().SerializeToString(), [bytes(4)])], "no"),
    ("small step, a batch and no request", fw.STEP, [(None, [bytes(12)])], "no record batch"),
    ("small step with a batch", fw.STEP, [(step_request(1, GRAD), [bytes(12)])], "no record"),
    ("small step, garbage", fw.STEP, [(b"\x0a\xff\xff\xff\xff\x0f", [])], "undecodable"),
    (
        "small step, NaN in the last tensor",
        fw.STEP,
        [(step_request(1, NAN_GRAD), [])],
        "non-finite",
    ),
    (
        "small step, wrong dtype",
        fw.STEP,
        [(step_request(1, {"b": np.ones(3, np.float64)}), [])],
        "float64",
    ),
]


@pytest.mark.parametrize(
    ("what", "command", "steps", "named"), GARBAGE, ids=[g[0] for g in GARBAGE]
)
def test_a_raw_flight_client_sending_garbage_gets_a_clear_status_and_changes_nothing(
    servers, what, command, steps, named
) -> None:
    server = servers()
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init(MODEL, psworker.SGD(lr=0.5))
        c.push_pull(GRAD)
        before = state(server)
        err = send_raw(server.data_port, command, steps)
        assert isinstance(err, InvalidRequestError), (what, err)
        assert err.code.name == "INVALID_ARGUMENT"
        assert named in str(err), (what, str(err))
        assert state(server) == before
        c.push_pull(GRAD)  # the shard still serves
        assert server.shard.status().pushes_applied == before[2] + 1


def test_the_byte_limits_hold_on_the_data_port(servers) -> None:
    # --max-request-bytes: checked from the manifest, before a byte is read.
    server = servers(shard=Shard(Limits(max_wait_s=5.0, max_request_bytes=40)))
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init({"b": np.ones(3, np.float32)}, psworker.SGD(lr=0.5))
        before = state(server)
        big = ps_pb2.TensorChunk(name="b", dtype="float32", shape=[30], total_bytes=120)
        err = send_raw(server.data_port, fw.PUSH_PULL, [(good_header(1, big), [bytes(120)])])
        assert isinstance(err, TooLargeError) and "over the limit of 40" in str(err)
        assert state(server) == before
        # A small step's tensors count the same (its framing aside).
        err = send_raw(server.data_port, fw.STEP, [(step_request(1, {"b": np.ones(30)}), [])])
        assert isinstance(err, TooLargeError) and "over the limit of 40" in str(err), err
        huge = b"\x00" * (40 + STEP_FRAMING_BYTES + 1)  # refused before it is parsed
        err = send_raw(server.data_port, fw.STEP, [(huge, [])])
        assert isinstance(err, TooLargeError) and "framing" in str(err), err
        assert state(server) == before
    # --max-inflight-bytes: bytes arriving at once across calls.
    server = servers(max_inflight_bytes=12)  # Init's 12 bytes fit; a 16-byte step does not
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init({"b": np.ones(3, np.float32)}, psworker.SGD(lr=0.5))
        before = state(server)
        extra = ps_pb2.TensorChunk(name="c", dtype="float32", shape=[1], total_bytes=4)
        b = ps_pb2.TensorChunk(name="b", dtype="float32", shape=[3], total_bytes=12)
        err = send_raw(server.data_port, fw.PUSH_PULL, [(good_header(1, b, extra), [bytes(16)])])
        assert isinstance(err, ShardBusyError) and "--max-inflight-bytes" in str(err), err
        assert err.code.name == "RESOURCE_EXHAUSTED"
        assert state(server) == before
        step = [(step_request(1, {"b": np.ones(3, np.float32)}), [])]  # 12 bytes and framing
        err = send_raw(server.data_port, fw.STEP, step)
        assert isinstance(err, ShardBusyError) and "--max-inflight-bytes" in str(err), err
        assert state(server) == before


def test_a_small_step_waiting_for_its_sync_round_holds_no_inflight_bytes(
    servers, monkeypatch
) -> None:
    # A small step's bytes count towards --max-inflight-bytes while they are read, not while
    # its push waits for the round: else worker 0's push, waiting, would hold the bytes
    # worker 1's needs, and worker 1's would be refused (ShardBusyError) instead of closing
    # the round.
    monkeypatch.delenv("PS_GRPC_BELOW_BYTES")  # the default rule: small steps, one message
    model = {"w": np.zeros(1024, np.float32)}
    server = servers(max_inflight_bytes=6 << 10)  # one 4 KiB step at a time, not two
    options = {"num_workers": 2, "mode": "sync", "timeout": 20.0}
    with contextlib.ExitStack() as stack:
        c0, c1 = (
            stack.enter_context(psworker.connect([server.address], worker_id=i, **options))
            for i in range(2)
        )
        c0.init(model, psworker.SGD(lr=0.5))
        c1.init(model, psworker.SGD(lr=0.5))
        first: dict[int, dict[str, np.ndarray]] = {}
        waiting = threading.Thread(
            target=lambda: first.setdefault(0, c0.push_pull({"w": np.zeros(1024, np.float32)}))
        )
        waiting.start()
        deadline = time.monotonic() + 10.0
        while server.shard.status().workers.get(0, (0, 0.0))[0] < 1:  # taken; it waits
            assert time.monotonic() < deadline, "worker 0's push never reached the shard"
            time.sleep(0.01)
        out = c1.push_pull({"w": np.ones(1024, np.float32)})
        waiting.join(10.0)
        assert not waiting.is_alive()
        assert [c.links[0].steps.name for c in (c0, c1)] == ["flight-step", "flight-step"]
        # The round's mean, (0 + 1) / 2, at lr 0.5.
        for got in (first[0], out):
            np.testing.assert_array_equal(got["w"], np.full(1024, -0.25, np.float32))


def test_a_worker_holds_at_most_its_step_streams_on_the_data_port(servers) -> None:
    server = servers(streams_per_worker=1)
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init(MODEL, psworker.SGD(lr=0.5))
        c.push_pull(GRAD)  # this worker's exchange, kept open
        before = state(server)
        err = send_raw(server.data_port, fw.PUSH_PULL, [(good_header(1), [bytes(12)])])
        assert isinstance(err, TooLargeError) and "open step streams" in str(err), err
        assert isinstance(err, PSError) and err.code.name == "RESOURCE_EXHAUSTED"
        assert state(server) == before
        c.push_pull(GRAD)


def test_mutual_tls_and_the_token_guard_the_data_port_from_the_same_settings(
    servers, tmp_path
) -> None:
    from psctl.certs import write_certs
    from pswire.security import ServerSecurity

    certs = write_certs(tmp_path, ["127.0.0.1", "localhost"])
    security = ServerSecurity(
        cert=certs.server_cert, key=certs.server_key, ca=certs.ca, token=TOKEN
    )
    server = servers(security=security)
    tls = {"tls_ca": certs.ca, "tls_cert": certs.client_cert, "tls_key": certs.client_key}
    with psworker.connect([server.address], worker_id=0, num_workers=1, token=TOKEN, **tls) as c:
        c.init(MODEL, psworker.SGD(lr=0.5))
        c.push_pull(GRAD)
        assert c.links[0].steps.name == "flight"
        before = state(server)
        # TLS but no client certificate: the handshake fails before any call.
        client = flight.FlightClient(
            f"grpc+tls://127.0.0.1:{server.data_port}", tls_root_certs=certs.ca.read_bytes()
        )
        try:
            with pytest.raises(flight.FlightUnavailableError):
                writer, reader = client.do_exchange(
                    flight.FlightDescriptor.for_command(fw.PUSH_PULL),
                    options=flight.FlightCallOptions(
                        timeout=5, headers=[(b"authorization", f"Bearer {TOKEN}".encode())]
                    ),
                )
                writer.begin(fw.SCHEMA)
                writer.write_metadata(good_header(1))
                reader.read_chunk()
        finally:
            client.close()
        # Plain TCP to a TLS port: refused too.
        assert send_raw(server.data_port, fw.PUSH_PULL, [(good_header(1), [bytes(12)])])
        assert state(server) == before


def test_many_small_tensors_stay_on_grpcio_where_one_large_one_takes_the_data_port(
    servers, monkeypatch
) -> None:
    # The default rule: only tensors Flight sends from their own memory (64 KiB or more)
    # count towards the 256 KiB; 2,000 tensors of 1 KiB (2 MB in all) are faster on grpcio.
    monkeypatch.setenv("PS_GRPC_BELOW_BYTES", str(256 << 10))
    server = servers()
    small = {f"v{i}": np.zeros(256, np.float32) for i in range(2000)}
    with psworker.connect([server.address], worker_id=0, num_workers=1) as c:
        c.init({**small, "big": np.zeros(1 << 17, np.float32)}, SGD)
        link = c.links[0]
        assert link.transport(link._flight_bytes(small)).name == "grpc"
        assert link.transport(link._flight_bytes({"big": np.ones(1 << 17, np.float32)})).name == (
            "flight"
        )
        c.push({k: np.ones_like(v) for k, v in small.items()})  # and the push arrives whole
        assert float(c.pull(["v1999"])["v1999"][0]) == -0.5
