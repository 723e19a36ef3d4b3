"""Unit tests for psworker.placement: placing variables and their dim-0 slices on shards."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from pswire.errors import UnknownVariableError
from psworker.placement import (
    DEFAULT_PART_BYTES,
    DEFAULT_SPLIT_BYTES,
    MAX_PARTS,
    Piece,
    ShardMap,
    VarInfo,
    plan,
)

DTYPES = ["float16", "float32", "float64", "int64", "uint8", "bool"]

var_shapes = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)


@st.composite
def models(draw: st.DrawFn, max_vars: int = 8) -> list[VarInfo]:
    names = draw(
        st.lists(
            st.text("abcdefgh.", min_size=1, max_size=6), min_size=0, max_size=max_vars, unique=True
        )
    )
    return [VarInfo(n, draw(var_shapes), draw(st.sampled_from(DTYPES))) for n in names]


num_shards_st = st.integers(1, 6)
# Small limits too, so that most variables get split and slice rounding matters.
split_bytes_st = st.one_of(st.integers(1, 64), st.integers(1, 600))
# Parts: none (0, the default), 1 MiB (these models never reach it), or small enough to cut
# many.
part_bytes_st = st.one_of(st.just(0), st.just(1 << 20), st.integers(1, 600))


def rows_of(v: VarInfo) -> int:
    return v.shape[0] if v.shape else 0


def expected_pieces(v: VarInfo, num_shards: int, split_bytes: int, part_bytes: int = 0) -> int:
    rows = rows_of(v)
    if rows < 2:
        return 1
    across = num_shards if v.nbytes > split_bytes else 1
    parts = min(MAX_PARTS, -(-v.nbytes // part_bytes)) if part_bytes else 1
    return min(rows, max(across, parts))


def random_arrays(variables: list[VarInfo], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for v in variables:
        raw = rng.integers(0, 256, size=v.nbytes, dtype=np.uint8)
        if v.dtype == "bool":
            raw &= 1
        out[v.name] = raw.view(v.dtype).reshape(v.shape)
    return out


# --- properties ----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(variables=models(), num_shards=num_shards_st, split_bytes=split_bytes_st)
def test_plan_is_deterministic(variables: list[VarInfo], num_shards: int, split_bytes: int) -> None:
    a = plan(variables, num_shards, split_bytes)
    b = plan([dataclasses.replace(v) for v in variables], num_shards, split_bytes)
    assert a == b
    assert a.digest() == b.digest()


@settings(max_examples=300, deadline=None)
@given(
    variables=models(),
    num_shards=num_shards_st,
    split_bytes=split_bytes_st,
    part_bytes=part_bytes_st,
)
def test_every_variable_is_covered_exactly_once(
    variables: list[VarInfo], num_shards: int, split_bytes: int, part_bytes: int
) -> None:
    m = plan(variables, num_shards, split_bytes, part_bytes)
    assert m.num_shards == num_shards
    assert m.variables == tuple(variables)
    assert {p.var for p in m.pieces} == {v.name for v in variables}
    assert len({p.key for p in m.pieces}) == len(m.pieces)
    assert sum(len(m.on_shard(s)) for s in range(num_shards)) == len(m.pieces)

    for v in variables:
        parts = m.pieces_of(v.name)
        rows = rows_of(v)
        k = expected_pieces(v, num_shards, split_bytes, part_bytes)
        assert len(parts) == k
        # Slices in row order, contiguous, covering [0, rows).
        assert parts[0].start == 0
        assert parts[-1].stop == rows
        for before, after in itertools.pairwise(parts):
            assert before.stop == after.start
        for i, p in enumerate(parts):
            assert 0 <= p.shard < num_shards
            assert p.dtype == v.dtype
            if k == 1:
                assert p.key == v.name
                assert p.shape == v.shape
            else:
                assert p.key == f"{v.name}/part{i}of{k}"
                assert p.stop > p.start
                assert p.shape == (p.stop - p.start, *v.shape[1:])
        # Slices are near-equal and share a shard only once every shard holds one.
        if k > 1:
            sizes = [p.stop - p.start for p in parts]
            assert max(sizes) - min(sizes) <= 1
            assert len({p.shard for p in parts}) == min(k, num_shards)

    assert sum(m.shard_bytes()) == sum(v.nbytes for v in variables)
    # Pieces listed in model order, then slice order: every process iterates them the same way.
    order = {v.name: i for i, v in enumerate(variables)}
    assert list(m.pieces) == sorted(m.pieces, key=lambda p: (order[p.var], p.start))


@settings(max_examples=300, deadline=None)
@given(
    variables=models(max_vars=10),
    num_shards=num_shards_st,
    split_bytes=split_bytes_st,
    part_bytes=part_bytes_st,
)
def test_shards_are_balanced_within_the_largest_piece(
    variables: list[VarInfo], num_shards: int, split_bytes: int, part_bytes: int
) -> None:
    m = plan(variables, num_shards, split_bytes, part_bytes)
    loads = m.shard_bytes()
    assert len(loads) == num_shards
    largest = max((p.nbytes for p in m.pieces), default=0)
    # Steer the search toward the worst spread it can find.
    target(float(max(loads) - min(loads) - largest))
    assert max(loads) - min(loads) <= largest


@st.composite
def matrices(draw: st.DrawFn) -> list[VarInfo]:
    """Byte matrices, many with one row (never split) and many with odd row counts."""
    dims = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 12)), min_size=1, max_size=6))
    return [VarInfo(f"m{i}", d, "uint8") for i, d in enumerate(dims)]


@settings(max_examples=1000, deadline=None)
@given(
    variables=matrices(),
    num_shards=st.integers(2, 4),
    split_bytes=st.integers(1, 24),
    part_bytes=st.integers(0, 24),
)
def test_balance_with_slices_of_unequal_rows(
    variables: list[VarInfo], num_shards: int, split_bytes: int, part_bytes: int
) -> None:
    m = plan(variables, num_shards, split_bytes, part_bytes)
    loads = m.shard_bytes()
    assert max(loads) - min(loads) <= max(p.nbytes for p in m.pieces)


def test_balance_when_a_later_slice_is_larger_than_an_earlier_one() -> None:
    # 5 rows in 2 slices round to 2 + 3 rows. Placing the 2-row slice first on the emptier shard
    # and the 3-row one on the fuller shard left loads [13, 2]: a spread of 11 > 10.
    m = plan([VarInfo("a", (1, 10), "uint8"), VarInfo("b", (5, 1), "uint8")], 2, split_bytes=4)
    assert [(p.key, p.stop - p.start) for p in m.pieces_of("b")] == [
        ("b/part0of2", 2),
        ("b/part1of2", 3),
    ]
    assert sorted(m.shard_bytes()) == [3, 12]


@settings(max_examples=100, deadline=None)
@given(
    variables=models(),
    num_shards=num_shards_st,
    split_bytes=split_bytes_st,
    part_bytes=part_bytes_st,
    seed=st.integers(0, 2**32 - 1),
)
def test_split_then_join_round_trips_exactly(
    variables: list[VarInfo], num_shards: int, split_bytes: int, part_bytes: int, seed: int
) -> None:
    m = plan(variables, num_shards, split_bytes, part_bytes)
    arrays = random_arrays(variables, seed)
    per_shard = m.split(arrays)
    assert len(per_shard) == num_shards
    for s, held in enumerate(per_shard):
        assert set(held) == {p.key for p in m.on_shard(s)}
        for p in m.on_shard(s):
            assert held[p.key].shape == p.shape
            assert held[p.key].dtype == np.dtype(p.dtype)
            # Views of the caller's arrays, not copies.
            assert held[p.key].size == 0 or np.shares_memory(held[p.key], arrays[p.var])

    merged = {k: a for held in per_shard for k, a in held.items()}
    names = [v.name for v in variables]
    joined = m.join(merged, names)
    assert list(joined) == names
    for name in names:
        assert joined[name].dtype == arrays[name].dtype
        assert joined[name].shape == arrays[name].shape
        assert joined[name].tobytes() == arrays[name].tobytes()


def test_split_of_a_subset_only_sends_those_variables() -> None:
    m = plan([VarInfo("a", (4, 2), "float32"), VarInfo("b", (3,), "float32")], 2, split_bytes=12)
    arrays = random_arrays(list(m.variables), 0)
    per_shard = m.split({"b": arrays["b"]})
    assert [k for held in per_shard for k in held] == ["b"]


# --- examples ------------------------------------------------------------------------------


def test_large_variable_is_split_across_all_shards() -> None:
    emb = VarInfo("emb", (10, 4), "float32")  # 160 bytes
    m = plan([emb, VarInfo("bias", (4,), "float32")], 4, split_bytes=100)
    parts = m.pieces_of("emb")
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert sorted(p.shard for p in parts) == [0, 1, 2, 3]
    (bias,) = m.pieces_of("bias")
    assert bias.key == "bias"


def test_a_variable_above_part_bytes_is_cut_into_parts_of_about_that_size() -> None:
    # The LM's 2048 x 512 float32 weight (4 MiB) on 2 shards: four 1 MiB parts, two on each
    # shard, so a streamed push's reply comes back part by part.
    w = VarInfo("ffn.weight", (2048, 512), "float32")
    m = plan([w, VarInfo("bias", (512,), "float32")], 2, part_bytes=1 << 20)
    parts = m.pieces_of("ffn.weight")
    assert [p.key for p in parts] == [f"ffn.weight/part{i}of4" for i in range(4)]
    assert {p.stop - p.start for p in parts} == {512}
    assert sorted(p.shard for p in parts) == [0, 0, 1, 1]
    assert m.pieces_of("bias")[0].key == "bias"
    # The default, part_bytes=0: one piece per shard above split_bytes (8 MiB) only.
    assert DEFAULT_PART_BYTES == 0
    assert [p.key for p in plan([w], 2).pieces] == ["ffn.weight"]


def test_parts_are_at_most_max_parts_and_rows() -> None:
    huge = VarInfo("emb", (1000, 4), "float32")  # 16,000 bytes
    assert len(plan([huge], 2, part_bytes=10).pieces) == MAX_PARTS
    tall = VarInfo("w", (3, 1000), "float32")
    assert len(plan([tall], 2, part_bytes=10).pieces) == 3
    at_limit = VarInfo("v", (25, 1), "float32")  # exactly part_bytes: not above it
    assert len(plan([at_limit], 2, part_bytes=100).pieces) == 1


def test_parts_on_one_shard_still_cut() -> None:
    m = plan([VarInfo("w", (8, 4), "float32")], 1, part_bytes=32)
    assert [(p.key, p.shard, p.start, p.stop) for p in m.pieces] == [
        (f"w/part{i}of4", 0, 2 * i, 2 * i + 2) for i in range(4)
    ]


def test_fewer_rows_than_shards_gives_one_row_per_piece() -> None:
    m = plan([VarInfo("w", (3, 100), "float64")], 8, split_bytes=1)
    assert [(p.start, p.stop) for p in m.pieces_of("w")] == [(0, 1), (1, 2), (2, 3)]
    assert len({p.shard for p in m.pieces}) == 3


@pytest.mark.parametrize(
    "var",
    [
        VarInfo("scalar", (), "float64"),
        VarInfo("one_row", (1, 1000), "float32"),
        VarInfo("at_limit", (25, 1), "float32"),  # exactly split_bytes: not above it
        VarInfo("empty", (0, 50), "float32"),
    ],
)
def test_not_split(var: VarInfo) -> None:
    m = plan([var], 4, split_bytes=100)
    (piece,) = m.pieces
    assert piece == Piece(var.name, var.name, 0, 0, rows_of(var), var.shape, var.dtype)


def test_single_shard_holds_everything_unsplit() -> None:
    vs = [VarInfo("a", (100, 100), "float32"), VarInfo("b", (7,), "int64")]
    m = plan(vs, 1, split_bytes=10)
    assert [p.key for p in m.pieces] == ["a", "b"]
    assert m.shard_bytes() == [40056]


def test_largest_first_to_least_loaded_lowest_index_on_ties() -> None:
    vs = [
        VarInfo("small", (1,), "float32"),
        VarInfo("big", (10,), "float32"),
        VarInfo("mid", (5,), "float32"),
    ]
    m = plan(vs, 2, split_bytes=DEFAULT_SPLIT_BYTES)
    assert {p.key: p.shard for p in m.pieces} == {"big": 0, "mid": 1, "small": 1}
    assert m.shard_bytes() == [40, 24]


def test_nbytes() -> None:
    assert VarInfo("s", (), "float64").nbytes == 8
    assert VarInfo("w", (3, 0, 2), "float32").nbytes == 0
    assert VarInfo("w", (3, 5), "float16").nbytes == 30


# --- digest --------------------------------------------------------------------------------

BASE = [VarInfo("fc1.weight", (128, 64), "float32"), VarInfo("fc1.bias", (128,), "float32")]


def digest(variables: list[VarInfo], num_shards: int = 2) -> str:
    return plan(variables, num_shards).digest()


def test_digest_depends_on_the_model_not_the_placement() -> None:
    assert digest(BASE) == digest(list(BASE))
    assert digest(BASE, num_shards=1) == digest(BASE, num_shards=5)
    assert len(digest(BASE)) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"name": "fc2.weight"},
        {"shape": (64, 128)},
        {"shape": (128, 64, 1)},
        {"dtype": "float64"},
    ],
)
def test_digest_changes_with_name_shape_or_dtype(change: dict) -> None:
    changed = [dataclasses.replace(BASE[0], **change), BASE[1]]
    assert digest(changed) != digest(BASE)


def test_digest_changes_with_order() -> None:
    assert digest(BASE[::-1]) != digest(BASE)


def test_digest_ignores_how_the_shape_was_spelled() -> None:
    # A list, numpy ints or torch.Size all describe the same model as a tuple of ints.
    spellings: list = [[3, 4], (np.int64(3), np.int32(4)), np.array([3, 4])]
    try:
        import torch
    except ImportError:
        pass
    else:
        spellings.append(torch.Size([3, 4]))
    want = digest([VarInfo("w", (3, 4), "float32")])
    for shape in spellings:
        var = VarInfo("w", shape, "float32")  # type: ignore[arg-type]
        assert var.shape == (3, 4)
        assert all(type(d) is int for d in var.shape)
        assert digest([var]) == want


def test_digest_is_not_fooled_by_separators_in_names() -> None:
    two = [VarInfo("a", (1,), "float32"), VarInfo("b", (2,), "float32")]
    one = [VarInfo("a:float32:(1,);b", (2,), "float32")]
    assert digest(one) != digest(two)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [0, -1])
def test_num_shards_below_one(num_shards: int) -> None:
    with pytest.raises(ValueError, match=f"num_shards must be >= 1, got {num_shards}"):
        plan(BASE, num_shards)


def test_duplicate_names() -> None:
    vs = [*BASE, VarInfo("fc1.bias", (3,), "float64")]
    with pytest.raises(ValueError, match=r"duplicated variable names: \['fc1.bias'\]"):
        plan(vs, 2)


def test_split_of_an_unknown_variable() -> None:
    m = plan(BASE, 2)
    with pytest.raises(UnknownVariableError, match=r"'conv\.weight'"):
        m.split({"conv.weight": np.zeros(3, dtype=np.float32)})


def test_join_of_an_unknown_variable() -> None:
    m = plan(BASE, 2)
    with pytest.raises(UnknownVariableError, match=r"'conv\.weight'"):
        m.join({}, ["conv.weight"])


def test_empty_model() -> None:
    m = plan([], 3)
    assert m == ShardMap(3, (), ())
    assert m.shard_bytes() == [0, 0, 0]
    assert m.split({}) == [{}, {}, {}]
    assert m.join({}, []) == {}


def test_join_returns_the_destination_when_pieces_were_decoded_into_it() -> None:
    shard_map = plan([VarInfo("emb", (10, 4), "float32"), VarInfo("b", (4,), "float32")], 2, 16)
    into = shard_map.destinations(["emb", "b"])
    assert sorted(into) == ["emb/part0of2", "emb/part1of2"]
    pieces = {k: v for k, v in into.items()}
    for k, v in pieces.items():
        v[...] = float(k[-4])  # as a decoder writing in place
    pieces["b"] = np.ones(4, np.float32)
    joined = shard_map.join(pieces, ["emb", "b"], into)
    assert joined["emb"] is into["emb/part0of2"].base
    assert joined["emb"][:5].tolist() == [[0.0] * 4] * 5 and joined["emb"][5:].min() == 1.0
    # Pieces that arrived elsewhere are concatenated as before.
    apart = {k: v.copy() for k, v in pieces.items()}
    assert np.array_equal(shard_map.join(apart, ["emb"], into)["emb"], joined["emb"])


def test_destinations_in_the_callers_arrays_and_join_returns_them() -> None:
    shard_map = plan([VarInfo("emb", (10, 4), "float32"), VarInfo("b", (4,), "float32")], 2, 16)
    out = {"emb": np.zeros((10, 4), np.float32), "b": np.zeros(4, np.float32)}
    into = shard_map.destinations(["emb", "b"], out)
    assert sorted(into) == ["b", "emb/part0of2", "emb/part1of2"]
    assert into["b"] is out["b"]
    assert all(np.shares_memory(into[k], out["emb"]) for k in ("emb/part0of2", "emb/part1of2"))
    into["emb/part1of2"][...] = 2.0  # decoded in place
    elsewhere = {"emb/part0of2": np.ones((5, 4), np.float32), "emb/part1of2": into["emb/part1of2"]}
    elsewhere["b"] = np.full(4, 3.0, np.float32)  # decoded elsewhere: copied in
    joined = shard_map.join(elsewhere, ["emb", "b"], into, out)
    assert joined["emb"] is out["emb"] and joined["b"] is out["b"]
    assert out["emb"][:5].min() == 1.0 and out["emb"][5:].min() == 2.0 and out["b"].min() == 3.0
