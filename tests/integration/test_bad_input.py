"""Every bad request gets its documented status, a message naming the values, and no change."""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import psworker
from psserver.records import Limits
from pswire.channel import insecure_channel
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.write import tensor_to_chunks

WEIGHTS = {
    "fc.weight": np.arange(12, dtype=np.float32).reshape(4, 3),
    "fc.bias": np.ones(3, np.float32),
}
StatusCode = grpc.StatusCode


@pytest.fixture
def served(shards):
    """One initialised shard (async, SGD), a raw stub to it, and a snapshot helper."""
    (server,) = shards(1, Limits(max_request_bytes=1 << 20, max_wait_s=5))
    client = psworker.connect(
        [server.address], worker_id=0, num_workers=1, mode="async", timeout=10
    )
    client.init(WEIGHTS, psworker.SGD(lr=0.1))
    channel = insecure_channel(server.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    before = server.shard.snapshot()
    yield server, client, stub, before
    client.close()
    channel.close()


def unchanged(server, before) -> None:
    after = server.shard.snapshot()
    assert after.keys() == before.keys()
    for k in before:
        assert after[k].tobytes() == before[k].tobytes(), f"variable {k} changed"


def push_stream(step: int, chunks: list[ps_pb2.TensorChunk]) -> Iterator[ps_pb2.PushRequest]:
    yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=0, step=step))
    for c in chunks:
        yield ps_pb2.PushRequest(chunk=c)


def raw_push(stub, chunks, step=0):
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(push_stream(step, chunks), timeout=10)
    return info.value


def chunks_of(name, array, chunk_bytes=1 << 20):
    return list(tensor_to_chunks(name, array, chunk_bytes))


def test_unknown_variable_is_not_found(served):
    server, client, _, before = served
    with pytest.raises(psworker.UnknownVariableError, match="conv9") as info:
        client.push({"conv9": np.zeros(3, np.float32)})
    assert info.value.code == StatusCode.NOT_FOUND
    with pytest.raises(psworker.UnknownVariableError, match="nope"):
        client.pull(["nope"])
    unchanged(server, before)


def test_unknown_variable_over_the_wire_is_not_found(served):
    server, _, stub, before = served
    err = raw_push(stub, chunks_of("conv9", np.zeros(3, np.float32)))
    assert err.code() == StatusCode.NOT_FOUND
    assert "conv9" in err.details() and "fc.weight" in err.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Pull(ps_pb2.PullRequest(worker_id=0, step=0, names=["ghost"]), timeout=10))
    assert info.value.code() == StatusCode.NOT_FOUND and "ghost" in info.value.details()
    unchanged(server, before)


@pytest.mark.parametrize(
    ("grad", "pattern"),
    [
        (np.zeros((3, 4), np.float32), r"'fc.weight' has shape \(4, 3\) on the server.*\(3, 4\)"),
        (np.zeros((4, 3), np.float64), r"'fc.weight' has dtype float32.*float64"),
        (np.full((4, 3), np.nan, np.float32), r"'fc.weight'.*12 non-finite"),
        (np.array([[np.inf, 0, 0]] * 4, np.float32), r"'fc.weight'.*4 non-finite"),
    ],
)
def test_wrong_shape_dtype_or_nonfinite_gradient_is_invalid(served, grad, pattern):
    server, _, stub, before = served
    err = raw_push(stub, chunks_of("fc.weight", grad))
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert re.search(pattern, err.details()), err.details()
    unchanged(server, before)
    assert server.shard.status().pushes_applied == 0


def test_wrong_byte_count_is_invalid(served):
    server, _, stub, before = served
    chunk = chunks_of("fc.weight", np.zeros((4, 3), np.float32))[0]
    chunk.total_bytes = 40
    chunk.data = chunk.data[:40]
    err = raw_push(stub, [chunk])
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "'fc.weight' declares 40 bytes" in err.details() and "48" in err.details()
    unchanged(server, before)


def test_truncated_and_out_of_order_chunks_are_invalid(served):
    server, _, stub, before = served
    chunks = chunks_of("fc.weight", np.ones((4, 3), np.float32), chunk_bytes=16)
    assert len(chunks) == 3
    err = raw_push(stub, chunks[:2])
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "'fc.weight' is truncated" in err.details() and "32 of 48" in err.details()
    err = raw_push(stub, [chunks[0], chunks[2], chunks[1]])
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "offset 32, expected 16" in err.details()
    # A valid gradient for the other variable in the same stream is not applied either.
    bias = chunks_of("fc.bias", np.ones(3, np.float32))
    err = raw_push(stub, bias + chunks[:1])
    assert err.code() == StatusCode.INVALID_ARGUMENT
    unchanged(server, before)


def test_malformed_stream_framing_is_invalid(served):
    server, _, stub, before = served
    chunk = chunks_of("fc.bias", np.ones(3, np.float32))[0]
    for stream, pattern in [
        ([ps_pb2.PushRequest(chunk=chunk)], "chunk before its header"),
        ([], "without a header"),
        ([ps_pb2.PushRequest(header=ps_pb2.PushHeader()), ps_pb2.PushRequest()], "empty message"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stub.Push(iter(stream), timeout=10)
        assert info.value.code() == StatusCode.INVALID_ARGUMENT
        assert pattern in info.value.details()
    unchanged(server, before)


def test_negative_and_huge_dims_are_invalid(served):
    server, _, stub, before = served
    for shape, pattern in [([-1, 3], "negative dim"), ([1 << 30, 1 << 30], "elements")]:
        chunk = ps_pb2.TensorChunk(name="fc.weight", dtype="float32", shape=shape, total_bytes=0)
        err = raw_push(stub, [chunk])
        assert err.code() == StatusCode.INVALID_ARGUMENT
        assert pattern in err.details() and "fc.weight" in err.details()
    unchanged(server, before)


def test_request_over_the_size_limit_is_resource_exhausted(served):
    server, _, stub, before = served
    big = np.zeros((1 << 19) + 1, np.float32)  # just over the 1 MiB limit of this shard
    err = raw_push(stub, chunks_of("fc.weight", big)[:1])
    assert err.code() == StatusCode.RESOURCE_EXHAUSTED
    assert "over the limit of 1048576" in err.details()
    unchanged(server, before)


def test_model_mode_and_optimizer_mismatch_are_failed_precondition(served, caplog):
    server, client, _, before = served
    # The job's worker leaves first: a second live process claiming worker 0 would be refused
    # as a duplicate before its model is even compared.
    client.close()
    cases = [
        (
            dict(mode="async"),
            {"fc.weight": np.zeros((4, 4), np.float32)},
            psworker.SGD(lr=0.1),
            r"variable 'fc.weight': shard has \(4, 3\) float32, worker sent \(4, 4\) float32",
        ),
        (
            dict(mode="sync"),
            WEIGHTS,
            psworker.SGD(lr=0.1),
            "mode: shard has 'async', worker sent 'sync'",
        ),
        (dict(mode="async"), WEIGHTS, psworker.Adam(), "optimizer"),
    ]
    for kwargs, weights, opt, pattern in cases:
        with psworker.connect([server.address], worker_id=0, num_workers=1, **kwargs) as other:
            with pytest.raises(psworker.ModelMismatchError, match=pattern) as info:
                other.init(weights, opt)
            assert info.value.code == StatusCode.FAILED_PRECONDITION
    other = psworker.connect([server.address], worker_id=1, num_workers=3, mode="async")
    with other, pytest.raises(psworker.ModelMismatchError, match="num_workers 3"):
        other.init(WEIGHTS, psworker.SGD(lr=0.1))
    unchanged(server, before)
    # Each refused process gave up its claim on worker id 0 as it closed: the next one took
    # the id at once instead of waiting out the claim's grace.
    assert "waiting for the old claim to lapse" not in caplog.text


def test_bad_job_description_is_invalid(served):
    server, _, stub, before = served
    for job, pattern in [
        (
            ps_pb2.JobSpec(mode="bogus", num_workers=1, optimizer=ps_pb2.OptimizerSpec(name="sgd")),
            "unknown mode 'bogus'",
        ),
        (
            ps_pb2.JobSpec(
                mode="async", num_workers=1, optimizer=ps_pb2.OptimizerSpec(name="lamb")
            ),
            "unknown optimizer 'lamb'",
        ),
        (
            ps_pb2.JobSpec(
                mode="async",
                num_workers=1,
                optimizer=ps_pb2.OptimizerSpec(name="sgd", params={"lr": float("nan")}),
            ),
            "'lr' is nan",
        ),
        (
            ps_pb2.JobSpec(
                mode="async",
                num_workers=1,
                optimizer=ps_pb2.OptimizerSpec(name="sgd"),
                variables=[ps_pb2.VariableSpec(name="v", dtype="complex64", shape=[2])],
            ),
            "'v' has unsupported dtype",
        ),
        (
            ps_pb2.JobSpec(
                mode="ssp", staleness=-1, num_workers=1, optimizer=ps_pb2.OptimizerSpec(name="sgd")
            ),
            "staleness must be >= 0",
        ),
    ]:
        header = ps_pb2.InitHeader(worker_id=0, job=job)
        with pytest.raises(grpc.RpcError) as info:
            stub.Init(iter([ps_pb2.InitRequest(header=header)]), timeout=10)
        assert info.value.code() == StatusCode.INVALID_ARGUMENT, info.value.details()
        assert pattern in info.value.details()
    unchanged(server, before)


def test_pull_or_push_before_init_is_failed_precondition(shards):
    (server,) = shards(1)
    with insecure_channel(server.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Pull(ps_pb2.PullRequest(worker_id=0, step=0), timeout=10))
        assert info.value.code() == StatusCode.FAILED_PRECONDITION
        assert "must call init" in info.value.details()


def test_worker_id_out_of_range_is_invalid(served):
    server, _, stub, before = served
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterWorker(ps_pb2.RegisterWorkerRequest(worker_id=5, num_workers=2), timeout=10)
    assert (
        info.value.code() == StatusCode.INVALID_ARGUMENT and "worker_id 5" in info.value.details()
    )
    unchanged(server, before)


def test_errors_sharing_a_status_code_arrive_as_their_own_class(shards) -> None:
    from pswire.errors import ModelMismatchError, NotInitializedError, ShapeMismatchError
    from pswire.proto import ps_pb2
    from pswire.rpc_errors import from_rpc_error

    (server,) = shards(1)
    with psworker.connect([server.address], mode="async") as client:
        # Straight to a shard that has no job yet: FAILED_PRECONDITION, NotInitializedError.
        request = ps_pb2.PullRequest(worker_id=0, step=0)
        with pytest.raises(grpc.RpcError) as raw:
            list(client.links[0].stub.Pull(request, timeout=10))
        assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert type(from_rpc_error(raw.value)) is NotInitializedError
        client.init({"w": np.zeros((2, 3), np.float32)}, psworker.SGD(lr=0.1))
        with pytest.raises(ShapeMismatchError, match=r"'w'.*\(2, 3\).*\(3, 2\)"):
            client.push({"w": np.zeros((3, 2), np.float32)})
    with (
        psworker.connect([server.address], mode="sync") as other,
        pytest.raises(ModelMismatchError, match="mode") as mismatch,
    ):
        other.init({"w": np.zeros((2, 3), np.float32)}, psworker.SGD(lr=0.1))
    assert type(mismatch.value) is ModelMismatchError


def test_a_push_stream_that_ends_before_the_tensors_it_announced_applies_nothing(served):
    """grpc can end the Push stream of a worker killed mid-push as if the worker had closed
    it: the header arrived, its tensors did not. Applied, that was an empty push: the step
    used up, the worker's gradients counted as zero in its sync round, and its restart's
    push of the step dropped as a duplicate (a DiLoCo job ended with exit 0 and another
    model). The header now says how many tensors follow: a short stream is refused."""
    server, client, stub, before = served
    grad = np.full(3, 0.5, np.float32)

    def announced(tensors: int, chunks: list) -> Iterator[ps_pb2.PushRequest]:
        yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=0, step=0, tensors=tensors))
        for c in chunks:
            yield ps_pb2.PushRequest(chunk=c)

    with pytest.raises(grpc.RpcError) as info:
        stub.Push(announced(2, chunks_of("fc.bias", grad)), timeout=10)
    assert info.value.code() == StatusCode.INVALID_ARGUMENT
    assert "step 0 by worker 0 ended after 1 of the 2 tensors" in info.value.details()
    unchanged(server, before)
    # The step is not used up: the whole push of it is applied, once.
    reply = stub.Push(announced(1, chunks_of("fc.bias", grad)), timeout=10)
    assert reply.applied
    assert np.allclose(client.pull(["fc.bias"])["fc.bias"], 1.0 - 0.1 * grad)
