"""A piece key names one piece: a variable or table whose name reads as a split variable's
slice key ('w/part0of2') is refused before anything is sent, and a pull never merges a piece
over another or one from a shard the plan does not place it on."""

from __future__ import annotations

import numpy as np
import pytest

import psworker
from pscore.tables import Table
from pswire.errors import InvalidRequestError, ModelMismatchError
from psworker.placement import VarInfo, plan


def test_a_variable_named_like_a_slice_of_a_split_one_is_refused_before_anything_is_sent(shards):
    servers = shards(2)
    # 'w' is 256 bytes > split_bytes: stored as 'w/part0of2' and 'w/part1of2'. Unchecked, the
    # pull merged the other variable's rows into 'w' (exit 0, a wrong model).
    model = {"w": np.arange(64, dtype=np.float32).reshape(16, 4), "w/part0of2": np.ones((8, 4))}
    with (
        psworker.connect(
            [s.address for s in servers], mode="sync", num_workers=1, split_bytes=64
        ) as client,
        pytest.raises(InvalidRequestError, match=r"\['w/part0of2'\] have the form"),
    ):
        client.init(model, psworker.SGD(lr=0.1))
    for server in servers:
        status = server.shard.status()
        assert not status.initialized and status.job is None and not status.workers


def test_such_a_name_is_refused_even_when_no_variable_is_split(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], mode="async") as client:
        with pytest.raises(InvalidRequestError, match=r"variable names \['b/part1of3'\]"):
            client.init({"b/part1of3": np.zeros(3)}, psworker.SGD(lr=0.1))
        with pytest.raises(InvalidRequestError, match=r"table names \['emb/part0of2'\]"):
            client.init(
                {"w": np.zeros(3)}, psworker.SGD(lr=0.1), tables={"emb/part0of2": Table(8, 2)}
            )
        assert not server.shard.status().initialized
        # Other slashes are fine.
        client.init({"enc/part0": np.zeros(3), "a/part1of": np.ones(2)}, psworker.SGD(lr=0.1))
        pulled = client.pull()
        assert np.array_equal(pulled["a/part1of"], np.ones(2))


def test_merging_replies_refuses_a_key_twice_or_from_a_shard_not_holding_it():
    m = plan([VarInfo("w", (16, 4), "float32"), VarInfo("b", (4,), "float32")], 2, 64)
    (p0, p1) = m.pieces_of("w")
    (b,) = m.pieces_of("b")
    rows = np.zeros((8, 4), np.float32)
    replies: list[dict[str, np.ndarray]] = [{}, {}]
    replies[p0.shard][p0.key] = rows
    replies[p1.shard][p1.key] = rows
    replies[b.shard][b.key] = np.zeros(4, np.float32)
    merged = m.merge(replies)
    assert sorted(merged) == sorted([p0.key, p1.key, b.key])
    twice: list[dict[str, np.ndarray]] = [dict(r) for r in replies]
    twice[1 - p0.shard][p0.key] = rows
    with pytest.raises(ModelMismatchError, match=f"shard {1 - p0.shard} replied with '{p0.key}'"):
        m.merge(twice)
    stranger: list[dict[str, np.ndarray]] = [dict(r) for r in replies]
    stranger[0]["w/part2of3"] = rows
    with pytest.raises(ModelMismatchError, match="places on no shard"):
        m.merge(stranger)
