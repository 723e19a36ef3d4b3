"""What a worker is told about a shard it cannot reach (psworker/link.py): the warning while
the link retries (which call, for how long, until when, the likely cause) and the errors of
``shard_status``, word for word; and no call the link makes waits forever on a shard that
takes the call and never answers."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from faults import FaultPlan, InjectedUnavailable
from link_cluster import grad
from ports import refused_address

import psworker
from pswire.errors import TooLargeError, UnavailableError, WaitTimeoutError
from pswire.proto import ps_pb2
from pswire.security import ClientSecurity
from psworker.link import ShardLink, shard_status
from psworker.session import LinkConfig

NOTHING_LISTENS = "nothing accepts connections there: is the shard running, on that host and port?"


@pytest.fixture
def refused() -> Iterator[tuple[ShardLink, grpc.RpcError]]:
    """A link to an address nothing listens on, and the error one call to it got."""
    address = refused_address()
    client = psworker.PSClient(
        psworker.ClientSettings(addresses=(address,), timeout=2.0, retry_s=30.0, heartbeat_s=0)
    )
    link = client.links[0]
    try:
        link.stub.Status(ps_pb2.StatusRequest(), timeout=2.0)
    except grpc.RpcError as exc:
        error = exc
    else:  # pragma: no cover - something took the port
        pytest.skip(f"{address} answered")
    yield link, error
    client.close()


def until(left: float) -> set[str]:
    """The wall-clock times ``left`` seconds from now, as the warning prints them (the
    second may turn while the test runs)."""
    now = time.time()
    return {time.strftime("%H:%M:%S", time.localtime(now + left + d)) for d in (-1, 0, 1)}


def test_the_first_warning_says_how_long_the_link_retries_until_when_and_why(refused) -> None:
    link, error = refused
    details = error.details()
    assert "Connection refused" in details
    said = link._unreachable(error, "Push", waited=0.99, left=100.0)
    where = re.escape(f"Push on shard 0 ({link.address})")
    m = re.fullmatch(
        rf"{where}: shard unreachable; retrying for up to 100s, until (\d\d:\d\d:\d\d) "
        rf"\(retry_s=30\): (.+)\. Likely cause: (.+)",
        said,
    )
    assert m, said
    assert m.group(1) in until(100.0)
    assert (m.group(2), m.group(3)) == (details, NOTHING_LISTENS)


def test_later_warnings_say_how_long_the_shard_has_been_unreachable(refused) -> None:
    link, error = refused
    for waited, shown in ((1.0, "1"), (7.6, "8")):
        said = link._unreachable(error, "Pull", waited=waited, left=22.4)
        m = re.fullmatch(
            rf"{re.escape(f'Pull on shard 0 ({link.address})')}: shard still unreachable after "
            rf"{shown}s; retrying until (\d\d:\d\d:\d\d) \(22s more\): .+Connection refused.*"
            rf"\. Likely cause: {re.escape(NOTHING_LISTENS)}",
            said,
        )
        assert m, said
        assert m.group(1) in until(22.4)


def test_a_warning_without_a_likely_cause_ends_with_grpcs_details(refused) -> None:
    link, _ = refused
    dropped = InjectedUnavailable("the connection was reset")
    assert link._unreachable(dropped, "Push", waited=0.0, left=5.0).endswith(
        "(retry_s=30): the connection was reset"
    )
    # An RpcError that is not a call (no details()): its text stands in.
    bare = grpc.RpcError("socket gone")
    assert link._unreachable(bare, "Push", waited=0.0, left=5.0).endswith(": socket gone")


def test_a_host_that_does_not_resolve_is_named_in_the_warning_and_the_error(refused) -> None:
    link, _ = refused
    lookup = InjectedUnavailable("DNS resolution failed: Domain name not found")
    cause = f". Likely cause: the host name in {link.address!r} does not resolve"
    assert link._unreachable(lookup, "Push", waited=0.0, left=5.0).endswith(cause)
    assert str(link._failure(lookup, "Push", 30.0, 9)).endswith(cause)


def test_the_error_of_an_unreachable_shard_adds_only_a_cause_it_knows(refused) -> None:
    link, error = refused
    where = f"Push on shard 0 ({link.address})"
    failure = link._failure(error, "Push", 30.04, 9)
    assert isinstance(failure, UnavailableError)
    assert str(failure) == (
        f"{where}: shard unreachable for 30.0s (9 attempts, retry_s=30): {error.details()}. "
        f"Likely cause: {NOTHING_LISTENS}"
    )
    reset = link._failure(InjectedUnavailable("the connection was reset"), "Push", 1.0, 2)
    assert str(reset) == (
        f"{where}: shard unreachable for 1.0s (2 attempts, retry_s=30): the connection was reset"
    )
    silent = link._failure(InjectedUnavailable(""), "Push", 1.0, 2)
    assert str(silent) == f"{where}: shard unreachable for 1.0s (2 attempts, retry_s=30): "
    # An RpcError that is not a call (no code(), no details()): reported as it is.
    assert str(link._failure(grpc.RpcError("socket gone"), "Push", 0.0, 1)).startswith(f"{where}: ")


def test_shard_status_names_the_shard_and_the_likely_cause() -> None:
    address = refused_address()
    with pytest.raises(UnavailableError) as info:
        shard_status([address], timeout=5)
    text = str(info.value)
    assert text.startswith(f"Status on shard 0 ({address}): ") and "Connection refused" in text
    assert text.endswith(f". Likely cause: {NOTHING_LISTENS}")
    with pytest.raises(UnavailableError) as info:
        shard_status(["nonexistent.invalid:7001"], timeout=5)
    assert str(info.value).startswith("Status on shard 0 (nonexistent.invalid:7001): ")
    assert str(info.value).endswith(
        ". Likely cause: the host name in 'nonexistent.invalid:7001' does not resolve"
    )


def test_shard_status_adds_no_cause_it_does_not_know() -> None:
    def draining(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is draining")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "pswire.v1.ParameterServer",
                {"Status": grpc.unary_unary_rpc_method_handler(draining)},
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(UnavailableError) as info:
            shard_status([f"127.0.0.1:{port}"], timeout=5)
    finally:
        server.stop(grace=0)
    assert str(info.value) == f"Status on shard 0 (127.0.0.1:{port}): the shard is draining"


@pytest.fixture
def silent() -> Iterator[str]:
    """The address of a server that takes Status, RegisterWorker, Checkpoint and Leave calls
    and never answers them (until the test ends)."""
    release = threading.Event()

    def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(hang)
    methods = {m: handler for m in ("Status", "RegisterWorker", "Checkpoint", "Leave")}
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("pswire.v1.ParameterServer", methods)]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    release.set()
    server.stop(grace=0)


@pytest.mark.timeout(20)  # a call without a deadline hangs until then
def test_no_call_waits_forever_on_a_shard_that_never_answers(
    silent: str, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=r"^Status on shard 0 .*Deadline Exceeded"):
        shard_status([silent], timeout=0.5)
    client = psworker.PSClient(
        psworker.ClientSettings(addresses=(silent,), timeout=0.5, retry_s=0.5, heartbeat_s=0)
    )
    try:
        link = client.links[0]
        with pytest.raises(WaitTimeoutError) as timed_out:
            link.call("Status", lambda stub: stub.Status(ps_pb2.StatusRequest(), timeout=0.5))
        assert str(timed_out.value) == (
            f"Status on shard 0 ({silent}): no answer within timeout=0.5s (the shard neither "
            "answered nor said what it waits for: is it overloaded or stuck?)"
        )
        with pytest.raises(grpc.RpcError) as info:
            link.register()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(TooLargeError, match="could not checkpoint"):
            link._make_room(limit=1)  # a full replay log asks the shard to checkpoint
        with caplog.at_level(logging.DEBUG, logger="psworker.link"):
            link.leave()  # best effort: it gives up, and says so only at DEBUG
        assert [r.getMessage() for r in caplog.records if "Leave" in r.getMessage()] == [
            f"Leave on shard 0 ({silent}) failed: StatusCode.DEADLINE_EXCEEDED"
        ]
    finally:
        client.close()
    assert time.monotonic() - start < 15  # five deadlines of 0.5 s, not a hang


def test_giving_up_on_an_unreachable_shard_says_for_how_long_and_how_many_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = refused_address()
    client = psworker.PSClient(
        psworker.ClientSettings(addresses=(address,), timeout=2.0, retry_s=0.6, heartbeat_s=0)
    )
    link = client.links[0]
    try:
        with (
            caplog.at_level(logging.INFO, logger="psworker.link"),
            pytest.raises(UnavailableError) as info,
        ):
            link.call("Status", lambda stub: stub.Status(ps_pb2.StatusRequest(), timeout=2.0))
    finally:
        client.close()
    retries = [r for r in caplog.records if "; retry " in r.getMessage()]
    m = re.match(
        rf"{re.escape(f'Status on shard 0 ({address})')}: shard unreachable for (\d+\.\d)s "
        r"\((\d+) attempts, retry_s=0\.6\): ",
        str(info.value),
    )
    assert m, str(info.value)
    assert 0.6 <= float(m.group(1)) < 10
    assert int(m.group(2)) == len(retries) + 1 >= 2  # every try, the first and each retry


def test_a_shard_back_after_a_warning_is_said_to_be_reachable_and_only_then(
    cluster, caplog: pytest.LogCaptureFixture
) -> None:
    c = cluster(FaultPlan("Push", {2, 3, 4}, "drop"))  # retry_s=10
    with caplog.at_level(logging.WARNING, logger="psworker.link"):
        c.link.push(0, grad(0))  # answered at once: nothing to say
        assert not caplog.records
        c.link.push(1, grad(1))  # dropped three times (one warning), then answered
    said = [r.getMessage() for r in caplog.records]
    where = f"Push on shard 0 ({c.server.address})"
    assert len(said) == 2, said
    assert said[0].startswith(f"{where}: shard unreachable; retrying for up to 10s, until ")
    assert said[1] == f"{where}: shard reachable again"


def test_a_call_the_client_closes_under_ends_saying_so(refused) -> None:
    link, _ = refused

    def closed_while_in_flight(stub):
        link.close()
        raise InjectedUnavailable("the channel went down with the client")

    with pytest.raises(psworker.ClientClosedError) as info:
        link.call("Push", closed_while_in_flight)
    assert str(info.value) == f"Push on shard 0 ({link.address}): the client was closed"


def test_an_rpc_error_that_is_not_a_call_is_reported_not_crashed_on(refused) -> None:
    link, _ = refused

    def fails(stub):
        raise grpc.RpcError("socket gone")

    with pytest.raises(psworker.PSError) as info:
        link.call("Push", fails)
    assert str(info.value) == f"Push on shard 0 ({link.address}): socket gone"


def test_the_likely_cause_follows_the_clients_own_tls_settings() -> None:
    channel = grpc.insecure_channel(refused_address())  # never called
    try:
        config = LinkConfig(
            worker_id=0, num_workers=1, timeout=1.0, retry_s=1.0, chunk_bytes=1 << 20
        )
        link = ShardLink(
            0, "shard:7001", channel, config, security=ClientSecurity(ca=Path("ca.pem"))
        )
        handshake = InjectedUnavailable("Tls handshake failed: WRONG_VERSION_NUMBER")
        assert str(link._failure(handshake, "Push", 1.0, 2)).endswith(
            ". Likely cause: TLS mismatch: this client expects TLS (tls_ca='ca.pem') but the "
            "shard answers in plaintext; start the shard with --tls-cert/--tls-key, or connect "
            "without tls_ca / $PS_TLS_CA"
        )
    finally:
        channel.close()
