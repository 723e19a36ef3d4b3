"""Large tensors stream in chunks; health, status and TF_CONFIG discovery work over gRPC."""

from __future__ import annotations

import json

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psworker
from pswire.channel import MAX_MESSAGE_BYTES, insecure_channel
from pswire.proto import ps_pb2
from pswire.stubs import SERVICE as SERVICE_NAME


def test_256_mib_variable_round_trips_through_chunked_streams(shards):
    (server,) = shards(1)
    rows = (256 << 20) // (4 * 1024)
    big = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
    assert big.nbytes >= 256 << 20 > MAX_MESSAGE_BYTES  # could never travel as one message
    with psworker.connect([server.address], worker_id=0, num_workers=1, mode="async") as client:
        client.init({"emb": big}, psworker.SGD(lr=1.0))
        pulled = client.pull()["emb"]
        assert pulled.shape == big.shape and np.array_equal(pulled, big)
        grad = np.ones_like(big)
        client.push({"emb": grad})
        del grad
        after = client.pull()["emb"]
    assert np.array_equal(after, big - 1.0)


def test_health_service_reports_serving(shards):
    (server,) = shards(1)
    with insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_connect_from_tf_config_and_status(shards, monkeypatch):
    servers = shards(2)
    spec = {
        "cluster": {"ps": [s.address for s in servers], "worker": ["w0:1", "w1:1"]},
        "task": {"type": "worker", "index": 1},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(spec))
    model = {"a": np.zeros((4, 2), np.float32), "b": np.zeros(3, np.float32)}
    addresses = [s.address for s in servers]
    with psworker.connect(addresses, worker_id=0, num_workers=2, mode="async") as chief:
        chief.init(model, psworker.SGD())  # worker 0 sends the initial values
    with psworker.connect(mode="async", timeout=10) as client:
        assert (client.worker_id, client.num_workers) == (1, 2)
        client.init(model, psworker.SGD())
        client.push({"a": np.ones((4, 2), np.float32), "b": np.ones(3, np.float32)})
        statuses = client.status()
    assert all(isinstance(s, ps_pb2.StatusResponse) for s in statuses)
    # Worker 1 is not the initialiser, but the job is recorded and its clock advanced.
    assert [s.job.mode for s in statuses] == ["async", "async"]
    held = sorted(v.name for s in statuses for v in s.job.variables)
    assert held == ["a", "b"]
    assert sum(s.pushes_applied for s in statuses) == 2
    clocks = {w.worker_id: w.clock for s in statuses for w in s.workers}
    assert clocks == {0: 0, 1: 1}


class _Context:
    """What the servicer asks of a call's context when it is called directly."""

    def time_remaining(self) -> float:
        return 10.0

    def add_callback(self, callback: object) -> bool:
        return True


def test_pulls_at_one_clock_share_one_encoded_reply_while_it_is_being_sent(shards):
    from psserver.servicer import ParameterServerServicer

    (server,) = shards(1)
    with psworker.connect([server.address], worker_id=0, num_workers=1, mode="async") as client:
        client.init({"w": np.arange(12, dtype=np.float32)}, psworker.SGD(lr=1.0))
        servicer = ParameterServerServicer(server.shard)
        first = servicer.Pull(ps_pb2.PullRequest(worker_id=0, step=1), _Context())
        message = next(first)  # the first reply is encoded and still being sent
        second = list(servicer.Pull(ps_pb2.PullRequest(worker_id=0, step=1), _Context()))
        assert second[0] is message  # one copy of the variables, not two
        client.push({"w": np.ones(12, np.float32)})  # the clock moves on
        third = list(servicer.Pull(ps_pb2.PullRequest(worker_id=0, step=1), _Context()))
        assert third[0] is not message and third[0] != message
        del first, second, third, message
        assert servicer._shared_pull() is None  # nothing kept once no reply is being sent


def test_pull_and_push_pull_decode_into_the_callers_arrays(shards):
    from pswire.errors import InvalidRequestError

    servers = shards(2)
    # 12 MB: cut into 12 parts of 1 MiB (part_bytes), on both shards.
    big = np.arange(3_000_000, dtype=np.float32).reshape(1_000_000, 3)
    small = np.arange(12, dtype=np.float32).reshape(3, 4)
    with psworker.connect(
        [s.address for s in servers], mode="async", timeout=30, part_bytes=1 << 20
    ) as client:
        client.init({"big": big, "small": small}, psworker.SGD(lr=1.0))
        parts = client.shard_map.pieces_of("big")
        assert len(parts) == 12 and {p.shard for p in parts} == {0, 1}
        out = {"big": np.zeros_like(big), "small": np.zeros((4, 3), np.float32).T}  # strided
        got = client.pull(out=out)
        assert got["big"] is out["big"] and got["small"] is out["small"]
        np.testing.assert_array_equal(out["big"], big)
        np.testing.assert_array_equal(out["small"], small)

        grads = {"big": np.ones_like(big), "small": np.ones_like(small)}
        got = client.push_pull(grads, out={"big": out["big"]})
        assert got["big"] is out["big"]
        np.testing.assert_array_equal(out["big"], big - 1)
        np.testing.assert_array_equal(got["small"], small - 1)

        bad = {
            "wrong shape": {"small": np.zeros((4, 3), np.float32)},
            "wrong dtype": {"small": np.zeros((3, 4), np.float64)},
            "read-only": {"small": np.frombuffer(bytes(48), np.float32).reshape(3, 4)},
            "not read": {"nope": np.zeros(3, np.float32)},
        }
        for arrays in bad.values():
            with pytest.raises(InvalidRequestError, match=r"out\['(small|nope)'\]"):
                client.pull(out=arrays)


def test_local_mode_pulls_into_the_callers_arrays_as_well():
    from pswire.errors import InvalidRequestError

    with psworker.connect(mode="local") as client:
        client.init({"w": np.arange(6, dtype=np.float32)}, psworker.SGD(lr=1.0))
        out = np.zeros(6, np.float32)
        assert client.pull(out={"w": out})["w"] is out
        np.testing.assert_array_equal(out, np.arange(6))
        with pytest.raises(InvalidRequestError, match=r"out\['w'\] is float64"):
            client.pull(out={"w": np.zeros(6)})
