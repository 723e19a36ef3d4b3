"""A dynamic table's rows from a file: each shard keeps exactly the rows of the ids that hash
to it, in the file's order, whatever the block the file is read in."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import pscore.tables
from pscore.tables import IDS_SUFFIX, TableSlice, dynamic_home, rows_from_file


@pytest.mark.parametrize("block_bytes", [12, 40, 1 << 26])  # one row a block, a few, all
def test_each_shard_keeps_its_own_ids_rows_in_the_files_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int
) -> None:
    monkeypatch.setattr(pscore.tables, "_FILE_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(3)
    ids = rng.choice(np.arange(-(10**6), 10**6), size=257, replace=False).astype(np.int64)
    rows = rng.standard_normal((len(ids), 3)).astype(np.float32)
    path = tmp_path / "t.safetensors"
    save_file({"t": rows, "t" + IDS_SUFFIX: ids}, str(path))
    spec = TableSlice("t", 3, init_from=str(path))
    seen = []
    for shard in range(3):
        got_ids, got_rows, _ = rows_from_file(spec, shard, 3)
        assert got_ids is not None
        mine = dynamic_home(ids, 3) == shard
        assert got_ids.tolist() == ids[mine].tolist()  # the file's order
        assert np.array_equal(got_rows, rows[mine])
        seen.extend(got_ids.tolist())
    assert sorted(seen) == sorted(ids.tolist())  # every row on exactly one shard
