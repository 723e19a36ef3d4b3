"""Large PushPull messages built and read by hand are protobuf's wire format, both ways."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.tables import RowSparse
from pswire import read, write
from pswire.codec import ChunkAssembler, push_pull_grads
from pswire.proto import ps_pb2

ROWS, DIM = 1024, 32  # 128 KiB of rows: over write.SMALL_BYTES


def pieces() -> dict[str, np.ndarray | RowSparse]:
    g = np.random.default_rng(1)
    return {
        "emb": RowSparse(g.choice(10**6, ROWS, replace=False), g.standard_normal((ROWS, DIM))),
        "w": g.standard_normal((3, 4)).astype(np.float32),
    }


def test_a_large_request_reads_back_the_same_through_protobuf_and_by_hand():
    header = ps_pb2.PushHeader(worker_id=3, step=41, incarnation="abc", session="s")
    header.values.add(group=1, params={"lr": 0.5})
    rows = [ps_pb2.RowQuery(table="emb", ids=np.arange(5, dtype="<i8").tobytes())]
    sent = pieces()
    data = write.request(header, sent, rows, timeout_ms=1234)
    assert isinstance(data, bytes) and len(data) >= write.SMALL_BYTES
    theirs = ps_pb2.PushPullRequest.FromString(data)
    ours = read.parse_request(data)
    assert isinstance(ours, read.StepRequest)
    for message in (theirs, ours):
        assert message.header == header and message.timeout_ms == 1234
        assert [(r.table, bytes(r.ids)) for r in message.rows] == [("emb", rows[0].ids)]
        grads = push_pull_grads(message, 1 << 30)
        emb = sent["emb"]
        assert isinstance(emb, RowSparse) and isinstance(grads["emb"], RowSparse)
        assert np.array_equal(grads["emb"].ids, emb.ids)
        assert np.array_equal(grads["emb"].values, emb.values)
        assert np.array_equal(grads["w"], sent["w"])
    # protobuf's own serialization of the same request reads back alike by hand.
    again = read.parse_request(theirs.SerializeToString())
    assert again.header == header and [bytes(r.ids) for r in again.rows] == [rows[0].ids]
    # A small one is the same one form: protobuf's own bytes for the same message (no
    # padding under SMALL_BYTES), read back by the one parser.
    small = write.request(header, {"w": sent["w"]}, rows, timeout_ms=7)
    theirs_small = ps_pb2.PushPullRequest(header=header, timeout_ms=7, rows=rows)
    theirs_small.chunks.append(write.tensor_to_proto("w", sent["w"]))
    assert small == theirs_small.SerializeToString()
    ours_small = read.parse_request(small)
    assert ours_small.timeout_ms == 7 and ours_small.header == header
    assert np.array_equal(push_pull_grads(ours_small, 1 << 30)["w"], sent["w"])


def test_a_large_reply_reads_back_the_same_and_is_a_snapshot():
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "emb": np.ones((ROWS, DIM))}
    tensors = write.reply_tensors(arrays, frozenset({"emb"}))
    arrays["w"] += 100  # the live variable moves on after the lock: the reply must not
    push = ps_pb2.PushResponse(applied=True, clock=9, next_step=5, job_id="j")
    data = write.reply(push, tensors, clock=9)
    assert isinstance(data, bytes)
    for message in (ps_pb2.PushPullResponse.FromString(data), read.parse_reply(data)):
        assert message.push == push and message.clock == 9
        assembler = ChunkAssembler()
        for chunk in message.chunks:
            assembler.add(chunk)
        got = assembler.finish()
        assert np.array_equal(got["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
        assert np.array_equal(got["emb"], np.ones((ROWS, DIM)))


def test_a_small_reply_is_protobufs_own_bytes_and_reads_back_by_the_one_parser():
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(2)}
    push = ps_pb2.PushResponse(applied=True, clock=4, job_id="j")
    data = write.reply(push, write.reply_tensors(arrays, frozenset()), clock=4)
    theirs = ps_pb2.PushPullResponse(push=push, clock=4)
    theirs.chunks.extend(write.tensor_to_proto(k, a) for k, a in arrays.items())
    assert data == theirs.SerializeToString()
    ours = read.parse_reply(data)
    assert ours.push == push and ours.clock == 4
    assembler = ChunkAssembler()
    for chunk in ours.chunks:
        assembler.add(chunk)
    got = assembler.finish()
    assert all(np.array_equal(got[k], a) for k, a in arrays.items())


def test_malformed_large_messages_raise():
    good = write.request(ps_pb2.PushHeader(worker_id=1), pieces(), [], timeout_ms=5)
    assert isinstance(good, bytes)
    with pytest.raises(ValueError):
        read.parse_request(good[:-3] + b"\x12\xff\xff")  # a field running past the end
    with pytest.raises(ValueError):
        read.parse_reply(b"\x1a\x05" + bytes(write.SMALL_BYTES))  # clock as bytes


def test_tensor_data_decoded_in_place_is_aligned():
    header = ps_pb2.PushHeader(worker_id=1, step=2, incarnation="x" * 7)
    for name in ("e", "emb", "a-longer-name"):
        sent = {name: RowSparse(np.arange(ROWS), np.ones((ROWS, DIM), np.float32))}
        data = write.request(header, sent, [], timeout_ms=5)
        assert isinstance(data, bytes)
        grads = push_pull_grads(read.parse_request(data), 1 << 30)
        assert grads[name].values.flags.aligned and grads[name].ids.flags.aligned
        arrays = {name: np.ones((ROWS, DIM), np.float32), "b": np.zeros(3, np.float64)}
        for job_id in ("", "j" * 5):
            push = ps_pb2.PushResponse(applied=True, job_id=job_id)
            reply = write.reply(push, write.reply_tensors(arrays, frozenset()), 3)
            assert isinstance(reply, bytes)
            assembler = ChunkAssembler()
            for chunk in read.parse_reply(reply).chunks:
                assembler.add(chunk)
            assert all(a.flags.aligned for a in assembler.finish().values())


def test_small_and_large_tensors_read_back_in_order_and_the_same_as_protobuf():
    # Runs of small chunks are parsed by protobuf at once, large ones by hand: the reader must
    # keep the message's order and give what protobuf's own parser gives.
    g = np.random.default_rng(2)
    sizes = [3, 5, 40_000, 1, 2, 7, 30_000, 4, 0, 6]
    sent = {f"t{i}": g.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    header = ps_pb2.PushHeader(worker_id=2, step=9)
    data = write.request(header, sent, [], timeout_ms=11)
    assert isinstance(data, bytes)
    ours, theirs = read.parse_request(data), ps_pb2.PushPullRequest.FromString(data)
    assert [c.name for c in ours.chunks] == [c.name for c in theirs.chunks] == list(sent)
    for mine, proto in zip(ours.chunks, theirs.chunks, strict=True):
        assert (mine.dtype, list(mine.shape), mine.total_bytes) == (
            proto.dtype,
            list(proto.shape),
            proto.total_bytes,
        )
        assert bytes(mine.data) == proto.data
    grads = push_pull_grads(ours, 1 << 30)
    assert all(np.array_equal(grads[k], v) for k, v in sent.items())
