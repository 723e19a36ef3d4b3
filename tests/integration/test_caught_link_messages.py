"""What a worker is told about a shard it cannot reach (psworker/link.py): the warning while
the link retries (which call, for how long, until when, the likely cause) and the errors of
``shard_status``, word for word; and no call the link makes waits forever on a shard that
takes the call and never answers."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from faults import InjectedUnavailable

import psworker
from pswire.errors import TooLargeError, UnavailableError, WaitTimeoutError
from pswire.proto import ps_pb2
from psworker.link import ShardLink, shard_status

NOTHING_LISTENS = "nothing accepts connections there: is the shard running, on that host and port?"


def refused_address() -> str:
    """A port nothing listens on: bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def refused() -> Iterator[tuple[ShardLink, grpc.RpcError]]:
    """A link to an address nothing listens on, and the error one call to it got."""
    address = refused_address()
    client = psworker.PSClient([address], 0, 1, timeout=2.0, retry_s=30.0, heartbeat_s=0)
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
    """The address of a server that takes Status, RegisterWorker and Checkpoint calls and
    never answers them (until the test ends)."""
    release = threading.Event()

    def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(hang)
    methods = {m: handler for m in ("Status", "RegisterWorker", "Checkpoint")}
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("pswire.v1.ParameterServer", methods)]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    release.set()
    server.stop(grace=0)


@pytest.mark.timeout(20)  # a call without a deadline hangs until then
def test_no_call_waits_forever_on_a_shard_that_never_answers(silent: str) -> None:
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=r"^Status on shard 0 .*Deadline Exceeded"):
        shard_status([silent], timeout=0.5)
    client = psworker.PSClient([silent], 0, 1, timeout=0.5, retry_s=0.5, heartbeat_s=0)
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
    finally:
        client.close()
    assert time.monotonic() - start < 15  # four deadlines of 0.5 s, not a hang
