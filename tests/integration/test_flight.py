"""The data port on Arrow Flight against a real Shard: steps, exactly-once, bad input, the token,
TLS, deadlines. The control port (grpcio) initialises; tensors then travel on Flight."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.flight as flight
import pytest

import psworker
from pscore.tables import RowSparse, Table
from psctl.certs import CertPaths, write_certs
from psserver.flight_service import RunningFlightService, start_flight_service
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire import flightwire as fw
from pswire.codec import float32_to_bfloat16
from pswire.errors import (
    InvalidRequestError,
    ShapeMismatchError,
    ShardRestartedError,
    TooLargeError,
    UnauthenticatedError,
    UnavailableError,
    UnknownVariableError,
    WaitTimeoutError,
)
from pswire.proto import ps_pb2
from pswire.security import ClientSecurity, ServerSecurity
from psworker.flight_link import FlightLink

pytestmark = pytest.mark.timeout(60)
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(3, np.float32)}
GRAD = {"w": np.ones((4, 3), np.float32), "b": np.full(3, 2.0, np.float32)}
LR = 0.5
TOKEN = "flight-t0ken_for.tests"


class Pair:
    """A shard's control server (grpcio) and data port (Flight) over one Shard."""

    def __init__(self, control: RunningServer, data: RunningFlightService) -> None:
        self.control, self.data = control, data
        self.shard = control.shard
        self.links: list[FlightLink] = []  # closed before the servers stop

    def state(self) -> tuple:
        """Variables, clock and counters: what a refused step must leave alone."""
        st = self.shard.status()
        values = {k: v.tobytes() for k, v in self.shard.snapshot().items()}
        return values, st.clock, st.pushes_applied, st.pushes_duplicate


@pytest.fixture
def pair() -> Iterator[Callable[..., Pair]]:
    """Factory: ``pair(limits=..., security=..., mode=..., workers=..., tables=...)`` starts
    both ports on 127.0.0.1 port 0 and initialises the model through the control port."""
    started: list[tuple[Pair, Any]] = []

    def make(
        limits: Limits | None = None,
        security: ServerSecurity | None = None,
        mode: str = "async",
        workers: int = 1,
        tables: dict[str, Table] | None = None,
        client_security: dict[str, Any] | None = None,
    ) -> Pair:
        shard = Shard(limits or Limits(max_wait_s=5.0))
        control = start_server(shard, security=security)
        data = start_flight_service(shard, security=security)
        p = Pair(control, data)
        client = psworker.connect(
            [control.address],
            worker_id=0,
            num_workers=workers,
            mode=mode,
            timeout=10,
            **(client_security or {}),
        )
        model = {} if tables else MODEL
        client.init(model, psworker.SGD(lr=LR), tables=tables)
        started.append((p, client))
        return p

    yield make
    for p, client in started:
        for link in p.links:
            link.close()
        client.close()
        p.data.stop()
        p.control.stop(grace=0.5)


def link_to(p: Pair, timeout: float = 10.0, piece_bytes: int = fw.PIECE_BYTES, **sec: Any):
    link = FlightLink(0, p.data.address, 0, timeout, ClientSecurity(**sec), piece_bytes)
    p.links.append(link)
    return link


def expected_after(steps: int) -> dict[str, np.ndarray]:
    return {k: MODEL[k] - steps * LR * GRAD[k] for k in MODEL}


@pytest.mark.parametrize("piece_bytes", [fw.PIECE_BYTES, 8])
def test_push_pull_applies_once_and_decodes_into_the_callers_arrays(pair, piece_bytes) -> None:
    p = pair()
    link = link_to(p, piece_bytes=piece_bytes)  # 8 bytes: every tensor in several batches
    out = {k: np.zeros_like(v) for k, v in MODEL.items()}
    for step in range(3):
        pushed, arrays = link.push_pull(step, GRAD, into=out)
        assert pushed.applied and pushed.next_step == step + 1
        for k in MODEL:
            assert np.shares_memory(arrays[k], out[k])  # landed in place
            np.testing.assert_array_equal(out[k], expected_after(step + 1)[k])
    assert p.shard.status().pushes_applied == 3
    link.close()


def test_a_retried_step_is_acknowledged_not_applied_twice(pair) -> None:
    p = pair()
    link = link_to(p)
    link.push_pull(0, GRAD)
    before = p.state()
    again, arrays = link.push_pull(0, GRAD)
    assert (again.applied, again.reason) == (False, "duplicate")
    np.testing.assert_array_equal(arrays["w"], expected_after(1)["w"])
    values, clock, applied, _ = p.state()
    assert (values, clock, applied) == before[:3]
    link.close()


def test_push_and_pull_each_on_a_call_of_their_own(pair) -> None:
    p = pair()
    link = link_to(p, piece_bytes=16)
    assert link.push(0, GRAD).applied
    out = {"w": np.zeros((4, 3), np.float32)}
    got = link.pull(ps_pb2.PullRequest(worker_id=0, step=1, names=["w"]), into=out)
    assert got.keys() == {"w"} and np.shares_memory(got["w"], out["w"])
    np.testing.assert_array_equal(out["w"], expected_after(1)["w"])
    link.close()


def test_the_exchange_stays_open_across_steps_and_reopens_after_an_error(pair) -> None:
    p = pair()
    link = link_to(p)
    link.push_pull(0, GRAD)
    first = link._open
    link.push_pull(1, GRAD)
    assert link._open is first
    with pytest.raises(UnknownVariableError):
        link.push_pull(2, {"ghost": np.ones(3, np.float32)})
    assert link._open is None
    pushed, _ = link.push_pull(2, GRAD)
    assert pushed.applied and link._open is not None
    link.close()


def test_bfloat16_gradients_arrive_widened(pair) -> None:
    p = pair()
    link = link_to(p)
    grads = {"w": float32_to_bfloat16(GRAD["w"] * 0.25), "b": GRAD["b"]}
    _, arrays = link.push_pull(0, grads)
    np.testing.assert_array_equal(arrays["w"], MODEL["w"] - LR * 0.25)
    link.close()


def test_table_rows_are_pushed_and_pulled_by_id(pair) -> None:
    p = pair(tables={"t": Table(8, 2, init="zeros")})
    link = link_to(p)
    ids = np.array([5, 1], dtype=np.int64)
    rows = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert link.push(0, {"t": RowSparse(ids, rows)}).applied
    query = ps_pb2.RowQuery(table="t", ids=np.array([1, 5, 0], "<i8").tobytes())
    got = link.pull(ps_pb2.PullRequest(worker_id=0, step=1, rows=[query]))
    np.testing.assert_array_equal(got["t"], -LR * np.array([[3, 4], [1, 2], [0, 0]], np.float32))
    link.close()


# -- bad input: the documented error, the values named, nothing changed ------------------------


BAD_STEPS = [
    ({"ghost": np.ones(3, np.float32)}, UnknownVariableError, "NOT_FOUND", "ghost"),
    ({"w": np.ones((3, 4), np.float32)}, ShapeMismatchError, "INVALID_ARGUMENT", r"\(4, 3\)"),
    ({"w": np.ones((4, 3), np.float64)}, InvalidRequestError, "INVALID_ARGUMENT", "float64"),
    (  # a valid tensor first: a shard applying tensor by tensor would change "w"
        {"w": GRAD["w"], "b": np.array([1.0, np.nan, 2.0], np.float32)},
        InvalidRequestError,
        "INVALID_ARGUMENT",
        "non-finite",
    ),
]


@pytest.mark.parametrize(("grads", "cls", "status", "named"), BAD_STEPS)
def test_bad_gradients_are_refused_with_their_status_and_change_nothing(
    pair, grads, cls, status, named
) -> None:
    p = pair()
    link = link_to(p)
    link.push_pull(0, GRAD)
    before = p.state()
    with pytest.raises(cls, match=named) as info:
        link.push_pull(1, grads)
    assert info.value.code.name == status
    assert p.state() == before
    link.close()


def test_an_oversized_step_is_resource_exhausted_and_changes_nothing(pair) -> None:
    p = pair(limits=Limits(max_wait_s=5.0, max_request_bytes=64))  # the model is 60 bytes
    link = link_to(p)
    before = p.state()
    with pytest.raises(TooLargeError, match="over the limit of 64") as info:
        link.push_pull(0, {**GRAD, "extra": np.ones(2, np.float32)})  # 68 bytes declared
    assert info.value.code.name == "RESOURCE_EXHAUSTED"
    assert p.state() == before
    link.close()


def raw_step(p: Pair, header: bytes, batches: list[tuple[np.ndarray, bytes | None]]) -> Exception:
    """Sends a hand-made step on a raw Flight client (``header`` on the first batch, or alone);
    returns the error the shard answers."""
    client = flight.FlightClient(f"grpc+tcp://{p.data.address}")
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(fw.PUSH_PULL))
    writer.begin(fw.SCHEMA)
    try:
        if not batches:
            writer.write_metadata(header)
        for i, (data, meta) in enumerate(batches):
            meta = header if i == 0 else meta
            raw = data.view(np.uint8)
            if meta is None:
                writer.write_batch(fw.as_batch(raw))
            else:
                writer.write_with_metadata(fw.as_batch(raw), meta)
        writer.done_writing()
        reader.read_chunk()
    except Exception as exc:
        return fw.from_flight_error(exc)
    finally:
        client.close()
    raise AssertionError("the shard accepted a malformed step")


def manifest(**fields: Any) -> Any:
    base = {"name": "b", "dtype": "float32", "shape": [3], "total_bytes": 12}
    return ps_pb2.TensorChunk(**{**base, **fields})


def header_of(*entries: Any) -> bytes:
    head = ps_pb2.PushHeader(worker_id=0, step=1)
    return ps_pb2.PushPullRequest(header=head, chunks=entries).SerializeToString()


ONES = np.ones(3, np.float32)
MALFORMED = [
    (header_of(manifest(total_bytes=16)), [(ONES, None)], "declares 16 bytes"),
    (header_of(manifest(dtype="complex64")), [(ONES, None)], "unsupported dtype"),
    (header_of(manifest(), manifest()), [(ONES, None)], "appears twice"),
    (header_of(manifest()), [(ONES[:2], None)], "stream ended in variable 'b' after 8 of 12"),
    (header_of(manifest()), [(np.ones(4, np.float32), None)], "4 bytes left over"),
    (header_of(manifest()), [(ONES[:1], None), (ONES[:2], b"x")], "a header arrived in 'b'"),
    (header_of(manifest(name="w")), [(ONES, None)], "has shape (4, 3) on the server"),
    (b"\xff\xff\xff", [], "undecodable PushPullRequest"),
]


@pytest.mark.parametrize(("header", "batches", "message"), MALFORMED)
def test_malformed_steps_are_invalid_argument_and_change_nothing(
    pair, header, batches, message
) -> None:
    p = pair()
    before = p.state()
    err = raw_step(p, header, batches)
    assert isinstance(err, InvalidRequestError), err
    assert message in str(err)
    assert p.state() == before


def test_a_stale_incarnation_is_aborted(pair) -> None:
    p = pair()
    link = link_to(p)
    before = p.state()
    with pytest.raises(ShardRestartedError) as info:
        link.push_pull(0, GRAD, incarnation="not-this-shard")
    assert info.value.code.name == "ABORTED"
    assert p.state() == before
    link.close()


# -- security, deadlines, reachability --------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_missing_or_wrong_token_is_unauthenticated_and_changes_nothing(pair, token) -> None:
    p = pair(security=ServerSecurity(token=TOKEN), client_security={"token": TOKEN})
    before = p.state()
    link = link_to(p, token=token)
    with pytest.raises(UnauthenticatedError, match="token") as info:
        link.push_pull(0, GRAD)
    assert info.value.code.name == "UNAUTHENTICATED"
    assert p.state() == before
    link.close()
    good = link_to(p, token=TOKEN)
    assert good.push_pull(0, GRAD)[0].applied
    good.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return write_certs(tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"])


def test_mutual_tls_with_the_token(pair, certs: CertPaths) -> None:
    security = ServerSecurity(
        cert=certs.server_cert, key=certs.server_key, ca=certs.ca, token=TOKEN
    )
    client = {"tls_ca": certs.ca, "tls_cert": certs.client_cert, "tls_key": certs.client_key}
    p = pair(security=security, client_security={**client, "token": TOKEN})
    sec = {"ca": certs.ca, "cert": certs.client_cert, "key": certs.client_key, "token": TOKEN}
    link = link_to(p, **sec)
    assert link.push_pull(0, GRAD)[0].applied
    link.close()
    before = p.state()
    no_cert = link_to(p, ca=certs.ca, token=TOKEN, timeout=5.0)
    with pytest.raises(UnavailableError):
        no_cert.push_pull(1, GRAD)
    no_cert.close()
    assert p.state() == before


def test_a_step_the_rule_holds_back_ends_within_its_deadline(pair) -> None:
    # Worker 1 never pushes: step 0 never closes. The shard would wait 30 s on its own.
    p = pair(mode="sync", workers=2, limits=Limits(max_wait_s=30.0))
    link = link_to(p, timeout=1.5)
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError) as info:
        link.push_pull(0, GRAD)
    assert time.monotonic() - started < 10.0
    assert info.value.code.name == "DEADLINE_EXCEEDED"
    link.close()


def test_an_unreachable_data_port_is_unavailable(pair) -> None:
    p = pair()
    p.data.stop()
    link = link_to(p, timeout=3.0)
    with pytest.raises(UnavailableError):
        link.push_pull(0, GRAD)
    link.close()
