"""Small fused steps on one open PushPullStream call: errors, deadlines, and the unary twin."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import psworker
from pscore.optim import SGD
from pswire.errors import InvalidRequestError, WaitTimeoutError
from pswire.proto import ps_pb2
from pswire.stubs import ParameterServerStub
from pswire.write import push_pull_request

SHAPES = {"w": (3, 4), "b": (4,)}


def values() -> dict[str, np.ndarray]:
    return {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in SHAPES.items()}


def ones() -> dict[str, np.ndarray]:
    return {k: np.ones(s, np.float32) for k, s in SHAPES.items()}


def test_steps_share_one_call_and_a_bad_step_changes_nothing_then_the_next_works(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], mode="async", timeout=10) as client:
        client.init(values(), SGD(lr=0.5))
        first = client.push_pull(ones())
        call = client.links[0].steps.open_call
        second = client.push_pull(ones())
        assert client.links[0].steps.open_call is call, "the second step reused the open call"
        np.testing.assert_array_equal(second["w"], first["w"] - 0.5)

        bad = ones()
        bad["w"][1, 2] = np.nan
        # Refused by the client before anything is sent: the open call stays as it was.
        with pytest.raises(InvalidRequestError, match=r"'w'.*non-finite"):
            client.push_pull(bad)
        assert client.links[0].steps.open_call is call
        # The same step sent anyway (past the client's checks) is refused by the shard, and
        # the error ends the call.
        with pytest.raises(InvalidRequestError, match=r"'w'.*non-finite"):
            client.links[0].push_pull(client.step, bad)
        assert server.shard.status().pushes_applied == 2
        np.testing.assert_array_equal(client.pull()["w"], second["w"])

        third = client.push_pull(ones())  # on a new call: the error ended the last one
        assert client.links[0].steps.open_call is not call
        np.testing.assert_array_equal(third["w"], second["w"] - 0.5)


def test_a_step_the_rule_keeps_waiting_ends_at_its_deadline(shards):
    (server,) = shards(1)
    # Sync with two workers, only one stepping: its step waits for the other's push.
    with psworker.connect(
        [server.address], worker_id=0, num_workers=2, mode="sync", timeout=1.0
    ) as client:
        client.init(values(), SGD(lr=0.5))
        start = time.monotonic()
        with pytest.raises(WaitTimeoutError):
            client.push_pull(ones())
        assert time.monotonic() - start < 10


def test_the_unary_push_pull_rpc_applies_and_refuses_like_the_stream(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], mode="async", timeout=10) as client:
        client.init(values(), SGD(lr=0.5))
        incarnation = client.links[0].incarnation
    with grpc.insecure_channel(server.address) as channel:
        stub = ParameterServerStub(channel)
        bad = ones()
        bad["b"][0] = np.inf
        with pytest.raises(grpc.RpcError) as info:
            stub.PushPull(push_pull_request(0, 0, bad, incarnation), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'b'" in info.value.details()
        assert server.shard.status().pushes_applied == 0

        reply = stub.PushPull(push_pull_request(0, 0, ones(), incarnation), timeout=10)
        assert reply.push.applied
        got = {c.name: np.frombuffer(c.data, np.float32).reshape(c.shape) for c in reply.chunks}
        np.testing.assert_array_equal(got["w"], values()["w"] - 0.5)


def test_a_stream_step_with_a_malformed_message_is_invalid_argument(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], mode="async", timeout=10) as client:
        client.init(values(), SGD(lr=0.5))
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/pswire.v1.ParameterServer/PushPullStream",
            request_serializer=lambda b: b,
            response_deserializer=ps_pb2.PushPullResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([b"\xff\xff\xff"]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "PushPullStream" in info.value.details()
    assert server.shard.status().pushes_applied == 0
