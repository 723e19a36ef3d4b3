"""Joining exported pieces into a module's state_dict: slices, buffer names, inconsistencies."""

from __future__ import annotations

import numpy as np
import pytest

from psctl.admin import BUFFER_PREFIX, join_pieces, save_state_dict
from pswire.errors import InvalidRequestError
from psworker.placement import VarInfo, plan


def test_join_reverses_the_partitioner_and_drops_the_buffer_prefix() -> None:
    rng = np.random.default_rng(0)
    model = {
        "emb.weight": rng.standard_normal((7, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(3).astype(np.float32),
        "buffer:bn.num_batches_tracked": np.array(4, np.int64),
    }
    shard_map = plan([VarInfo(n, a.shape, a.dtype.name) for n, a in model.items()], 3, 16)
    pieces = shard_map.split(model)
    assert any("/part" in key for shard in pieces for key in shard), "emb.weight must be split"
    joined = join_pieces(pieces)
    assert sorted(joined) == ["bn.num_batches_tracked", "emb.weight", "fc.bias"]
    for name, array in model.items():
        np.testing.assert_array_equal(joined[name.removeprefix(BUFFER_PREFIX)], array)


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([{"w/part0of2": np.zeros(1)}], r"slices \[0\] of \[2\]"),
        ([{"w/part0of2": np.zeros(1)}, {"w/part1of3": np.zeros(1)}], "of \\[2, 3\\]"),
        ([{"w": np.zeros(1)}, {"w": np.zeros(1)}], "held by two shards"),
        ([{"w": np.zeros(1), "w/part0of1": np.zeros(1)}], "both whole and in slices"),
        ([{"x": np.zeros(1), "buffer:x": np.zeros(1)}], "both a parameter and a buffer"),
    ],
)
def test_inconsistent_pieces_are_refused(pieces, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        join_pieces(pieces)


def test_buffer_prefix_matches_the_torch_integration() -> None:
    torch_module = pytest.importorskip("psworker.torch")
    assert torch_module.BUFFER_PREFIX == BUFFER_PREFIX


def test_safetensors_suffix_writes_safetensors(tmp_path) -> None:
    import safetensors.numpy

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.array(2, np.int64)}
    path, fmt = save_state_dict(tensors, tmp_path / "m.safetensors")
    assert (path, fmt) == (tmp_path / "m.safetensors", "safetensors")
    loaded = safetensors.numpy.load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(loaded[name], array)
        assert loaded[name].shape == array.shape
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"], "no temp file left"
