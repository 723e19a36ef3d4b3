"""The partitioner's edges a mutation run showed untested: arrays offered to receive a pull
(``out``), joining split variables into them, each table's per-shard slice, id checks at the
ends of a fixed table, and the tables' part of the model digest."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pscore.tables import Table, TableSlice
from pswire.errors import InvalidRequestError
from psworker.placement import TableLayout, VarInfo, check_out, plan, tables_digest

MODEL = [VarInfo("big", (6, 4), "float32"), VarInfo("b", (3,), "float64")]


def split_map():
    shard_map = plan(MODEL, 3, split_bytes=16)  # "big" (96 bytes) in 3 slices, "b" too (24)
    assert len(shard_map.pieces_of("big")) == 3
    return shard_map


def pieces_of(shard_map, arrays):
    return {k: v.copy() for per_shard in shard_map.split(arrays) for k, v in per_shard.items()}


FULL = {"big": np.arange(24, dtype=np.float32).reshape(6, 4), "b": np.array([1.0, 2.0, 3.0])}


def test_check_out_refuses_what_a_pull_cannot_decode_into() -> None:
    variables = {"w": ((2, 3), "float32")}
    check_out(None, variables)
    check_out({"w": np.zeros((2, 3), np.float32)}, variables)
    bad = [
        ({"v": np.zeros((2, 3), np.float32)}, r"out\['v'\]: this pull does not read 'v'"),
        ({"w": np.zeros((3, 2), np.float32)}, r"out\['w'\] is float32 \(3, 2\); the variable"),
        ({"w": np.zeros((2, 3), np.float64)}, r"out\['w'\] is float64 \(2, 3\)"),
    ]
    frozen = np.zeros((2, 3), np.float32)
    frozen.flags.writeable = False
    bad.append(({"w": frozen}, r"out\['w'\] is read-only"))
    for out, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            check_out(out, variables)
    shard_map = split_map()
    shard_map.check_out(None, ["big"])
    shard_map.check_out({"big": np.zeros((6, 4), np.float32)}, ["big", "b"])
    with pytest.raises(InvalidRequestError, match="does not read 'big'"):
        shard_map.check_out({"big": np.zeros((6, 4), np.float32)}, ["b"])  # not asked for
    with pytest.raises(InvalidRequestError, match=r"out\['b'\] is float32"):
        shard_map.check_out({"b": np.zeros(3, np.float32)}, ["big", "b"])


def test_split_variables_are_joined_in_their_dtype_into_new_or_given_arrays() -> None:
    shard_map = split_map()
    names = ["big", "b"]
    # Decoded elsewhere: joined by a copy, in the variable's dtype and shape.
    joined = shard_map.join(pieces_of(shard_map, FULL), names)
    for name in names:
        assert joined[name].dtype == FULL[name].dtype
        np.testing.assert_array_equal(joined[name], FULL[name])
    # Decoded into destinations: the pieces are views of one array, returned without a copy.
    into = shard_map.destinations(names)
    assert {into[k].dtype for k in into} == {np.dtype(np.float32), np.dtype(np.float64)}
    decoded = {}
    for key, target in into.items():
        source = pieces_of(shard_map, FULL)[key]
        np.copyto(target, source)
        decoded[key] = target
    joined = shard_map.join(decoded, names, into=into)
    np.testing.assert_array_equal(joined["big"], FULL["big"])
    assert all(np.shares_memory(joined["big"], into[p.key]) for p in shard_map.pieces_of("big"))
    # One piece decoded elsewhere: not all views, so the join copies.
    mixed = dict(decoded)
    first = shard_map.pieces_of("big")[0].key
    mixed[first] = decoded[first].copy()
    joined = shard_map.join(mixed, names, into=into)
    assert not np.shares_memory(joined["big"], into[first])
    np.testing.assert_array_equal(joined["big"], FULL["big"])
    # Into the caller's arrays: each piece copied to its rows, or left where it was decoded.
    out = {"big": np.zeros((6, 4), np.float32), "b": np.zeros(3)}
    joined = shard_map.join(pieces_of(shard_map, FULL), names, out=out)
    assert joined["big"] is out["big"] and joined["b"] is out["b"]
    np.testing.assert_array_equal(out["big"], FULL["big"])
    np.testing.assert_array_equal(out["b"], FULL["b"])
    direct = shard_map.destinations(names, out={"big": out["big"]})
    assert all(np.shares_memory(v, out["big"]) for k, v in direct.items() if k.startswith("big"))


def test_each_shard_gets_its_slice_of_a_table_with_every_setting() -> None:
    table = Table(10, 4, "float32", init="uniform", init_scale=0.5, seed=7, capacity=0)
    layout = TableLayout.build("emb", table, 3)
    assert layout.bounds == (0, 3, 7, 10)
    assert layout.slice_for(1) == TableSlice("emb", 4, "float32", 10, 3, 7, 0, "uniform", 0.5, 7)
    hashed = TableLayout.build("h", Table(None, 2, "float64", capacity=5, seed=3), 2)
    assert hashed.bounds == ()
    assert hashed.slice_for(1) == TableSlice("h", 2, "float64", 0, 0, 0, 5, "normal", 1.0, 3)


def test_fixed_table_ids_are_checked_at_both_ends_and_placed_by_range() -> None:
    layout = TableLayout.build("emb", Table(10, 2), 3)
    layout.check_ids(np.array([0, 9]), "pull")
    layout.check_ids(np.array([], dtype=np.int64), "pull")
    for bad in ([-1], [10], [0, 12, -3]):
        with pytest.raises(InvalidRequestError, match=r"table 'emb': push has id -?\d+, outside"):
            layout.check_ids(np.array(bad), "push")
    assert layout.shard_of(np.array([0, 2, 3, 6, 7, 9])).tolist() == [0, 0, 1, 1, 2, 2]
    single = TableLayout.build("emb", Table(10, 2), 1)
    placed = single.shard_of(np.array([0, 5, 9]))
    assert placed.tolist() == [0, 0, 0] and placed.dtype == np.int64
    assert TableLayout.build("h", Table(None, 2), 1).shard_of(np.array([2**40])).tolist() == [0]


def test_the_tables_digest_is_canonical_text_of_every_table() -> None:
    tables = {"b": Table(None, 2, seed=1), "a": Table(5, 3)}
    text = tables_digest(tables)
    assert text == tables_digest(dict(reversed(tables.items())))
    assert list(json.loads(text)) == ["a", "b"]
    assert json.loads(text)["a"] == Table(5, 3).describe()
    assert text.index('"capacity"') < text.index('"dim"')  # keys sorted inside each table too
    assert tables_digest({}) == "{}"


def test_two_shards_split_a_fixed_table_and_scalars_join_into_given_arrays() -> None:
    layout = TableLayout.build("emb", Table(10, 2), 2)
    assert layout.shard_of(np.array([0, 4, 5, 9])).tolist() == [0, 0, 1, 1]
    hashed = TableLayout.build("h", Table(None, 2), 2).shard_of(np.arange(64, dtype=np.int64))
    assert set(hashed.tolist()) == {0, 1}
    shard_map = plan([VarInfo("step", (), "int64"), VarInfo("w", (2,), "float32")], 2)
    pieces = {"step": np.array(7, np.int64), "w": np.array([1.0, 2.0], np.float32)}
    out = {"step": np.array(0, np.int64), "w": np.zeros(2, np.float32)}
    joined = shard_map.join(pieces, ["step", "w"], out=out)
    assert joined["step"] is out["step"] and int(out["step"]) == 7
    np.testing.assert_array_equal(out["w"], [1.0, 2.0])
