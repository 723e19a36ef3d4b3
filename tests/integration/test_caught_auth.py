"""A call carrying several authorization headers is refused, whatever the first one holds: a
proxy or client that appends a header must not turn a wrong token into a right one, nor the
other way round. Real server on port 0, raw channel with hand-made metadata."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import psworker
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.security import ClientSecurity, ServerSecurity
from pswire.write import tensor_to_chunks

TOKEN = "s3cret-token_for.tests"
RIGHT = ("authorization", "Bearer " + TOKEN)
WRONG = ("authorization", "Bearer not-the-token")
MODEL = {"w": np.zeros(3, np.float32)}


@pytest.fixture(autouse=True)
def no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_TOKEN", "PS_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server() -> Iterator[RunningServer]:
    running = start_server(Shard(Limits(max_wait_s=5)), security=ServerSecurity(token=TOKEN))
    try:
        client = psworker.connect(
            [running.address], worker_id=0, num_workers=1, mode="async", timeout=10, token=TOKEN
        )
        client.init(MODEL, psworker.SGD(lr=1.0))
        client.close()
        yield running
    finally:
        running.stop(grace=0.5)


def push(address: str, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    """A well-formed push of step 0 with exactly ``metadata``; its status code."""

    def stream() -> Iterator[ps_pb2.PushRequest]:
        yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=0, step=0))
        for chunk in tensor_to_chunks("w", np.ones(3, np.float32)):
            yield ps_pb2.PushRequest(chunk=chunk)

    with ClientSecurity().channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        try:
            stub.Push(stream(), timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    "headers",
    [[RIGHT, WRONG], [WRONG, RIGHT], [RIGHT, RIGHT], [RIGHT, ("authorization", "")]],
    ids=["right-then-wrong", "wrong-then-right", "right-twice", "right-then-empty"],
)
def test_several_authorization_headers_are_unauthenticated_and_change_nothing(
    server: RunningServer, headers: list[tuple[str, str]]
) -> None:
    assert push(server.address, headers) == grpc.StatusCode.UNAUTHENTICATED
    status = server.shard.status()
    assert (status.clock, status.pushes_applied) == (0, 0)
    np.testing.assert_array_equal(server.shard.snapshot()["w"], MODEL["w"])
    # The same push with the one right header goes through: the refusal was the headers'.
    assert push(server.address, [RIGHT]) == grpc.StatusCode.OK
    assert server.shard.status().pushes_applied == 1
