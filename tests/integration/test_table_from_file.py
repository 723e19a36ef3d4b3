"""A table's rows from a file (``Table(..., init_from=...)``): a table, fixed or dynamic,
trained on two shards and exported goes on from three, bit for bit; a file that cannot be the
table's is refused at init, naming the table and the file, and leaves the shards as they
were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import psworker
from pscore.tables import IDS_SUFFIX, RowSparse, Table, init_rows
from psctl.admin import export_state_dict
from psserver.records import Limits
from pswire.errors import InvalidRequestError
from psworker.link import shard_status

ROWS, DIM = 11, 3
NAME = "user.weight"


def trained_and_exported(shards, path: Path) -> np.ndarray:
    """Trains a table on 2 shards (a few rows, SGD) and exports it; returns its rows."""
    addresses = [s.address for s in shards(2)]
    with psworker.connect(addresses, mode="async") as client:
        client.init(
            {"fc": np.ones(2, np.float32)},
            psworker.SGD(lr=0.5),
            tables={NAME: Table(ROWS, DIM, init="uniform", seed=4)},
        )
        for ids in ([0, 5, 10], [5, 6]):
            client.push({NAME: RowSparse(ids, np.full((len(ids), DIM), 0.25, np.float32))})
        rows = client.pull_rows(NAME, np.arange(ROWS))
    export_state_dict(addresses, path, timeout=10)
    return rows


def test_a_table_trained_on_two_shards_goes_on_from_three(shards, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    trained = trained_and_exported(shards, path)
    addresses = [s.address for s in shards(3, Limits(table_files=str(tmp_path)))]
    tables = {NAME: Table(ROWS, DIM, init_from=str(path))}
    with psworker.connect(addresses, mode="sync") as client:
        client.init({"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables=tables)
        path.unlink()  # read once, when the table was made: nothing later needs the file
        assert np.array_equal(client.pull_rows(NAME, np.arange(ROWS)), trained)
        # Each of the three shards holds its own range of the rows (ids 0-3, 4-6, 7-10).
        client.push({NAME: RowSparse([1, 5, 9], np.ones((3, DIM), np.float32))})
        after = client.pull_rows(NAME, np.arange(ROWS))
    expected = trained.copy()
    expected[[1, 5, 9]] -= 1.0
    assert np.array_equal(after, expected)
    # Worker 0 started again, its file gone: the shards hold the rows and read nothing.
    with psworker.connect(addresses, mode="sync") as client:
        client.init({"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables=tables)
        assert np.array_equal(client.pull_rows(NAME, np.arange(ROWS)), expected)


OPTIMIZERS = {
    "adam": lambda: psworker.Adam(lr=0.1),
    "adagrad": lambda: psworker.Adagrad(lr=0.5, lr_decay=0.1),
    "momentum": lambda: psworker.SGD(lr=0.5, momentum=0.9),
}
# Updates of (ids, gradient value): the first three before the change of shard count, the
# rest after (some rows touched before and after, some only after, one never).
UPDATES = [([0, 5, 10], 0.25), ([5, 6], -0.5), ([0, 6], 1.0), ([5, 9, 0], 0.75), ([2, 6], -1.0)]


def train_rows(client: psworker.PSClient, table: str, updates: list, ids: np.ndarray) -> None:
    for touched, value in updates:
        grad = np.full((len(touched), DIM), value, np.float32) * np.arange(
            1, DIM + 1, dtype=np.float32
        )
        client.push({table: RowSparse(np.asarray(ids)[touched], grad)})


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_tables_optimizer_state_goes_on_from_another_shard_count(
    shards, tmp_path: Path, optimizer: str, dynamic: bool
) -> None:
    """Adam's moments and step, Adagrad's sums and step, momentum's buffers travel in the
    file beside the rows: 2 shards, then 3 from the file, end as one uninterrupted run. Was:
    the state started fresh (Adam's first steps again: far off)."""
    spec = Table(None if dynamic else ROWS, DIM, init="uniform", seed=4)
    ids = (
        np.array([7, -3, 2**40 + 1, 12, 99, 5, 61, 8, 2**33, 0, 1]) if dynamic else np.arange(ROWS)
    )
    with psworker.connect(mode="local") as client:
        client.init({}, OPTIMIZERS[optimizer](), tables={NAME: spec})
        train_rows(client, NAME, UPDATES, ids)
        expected = client.pull_rows(NAME, ids)
    path = tmp_path / "model.safetensors"
    addresses = [s.address for s in shards(2)]
    with psworker.connect(addresses, mode="sync") as client:
        client.init({}, OPTIMIZERS[optimizer](), tables={NAME: spec})
        train_rows(client, NAME, UPDATES[:3], ids)
    export_state_dict(addresses, path, timeout=10)
    with safe_open(str(path), framework="np") as f:
        saved = sorted(f.keys())
    state = {"adam": ["exp_avg", "exp_avg_sq", "step"], "adagrad": ["step", "sum"]}
    slots = state.get(optimizer, ["momentum_buffer"])
    assert saved == sorted([NAME, *(f"{NAME}.{k}" for k in slots)] + [NAME + IDS_SUFFIX] * dynamic)
    addresses = [s.address for s in shards(3, Limits(table_files=str(tmp_path)))]
    later = Table(None if dynamic else ROWS, DIM, init="uniform", seed=4, init_from=str(path))
    with psworker.connect(addresses, mode="sync") as client:
        client.init({}, OPTIMIZERS[optimizer](), tables={NAME: later})
        train_rows(client, NAME, UPDATES[3:], ids)
        after = client.pull_rows(NAME, ids)
    assert np.array_equal(after, expected)


def test_a_file_whose_optimizer_state_cannot_be_the_tables_is_refused(
    shards, tmp_path: Path
) -> None:
    addresses = [s.address for s in shards(2, Limits(table_files=str(tmp_path)))]
    rows = np.zeros((ROWS, DIM), np.float32)
    nan = rows.copy()
    nan[4, 2] = np.nan
    step = np.asarray(3, np.int64)
    moments = {f"{NAME}.exp_avg": rows, f"{NAME}.exp_avg_sq": rows, f"{NAME}.step": step}
    cases = {
        "part": (
            {f"{NAME}.exp_avg": rows},
            r"holds the optimizer state \['user.weight.exp_avg'\] "
            r"but not \['user.weight.exp_avg_sq', 'user.weight.step'\]",
        ),
        "nan": (
            {**moments, f"{NAME}.exp_avg_sq": nan},
            r"'user.weight.exp_avg_sq' \(optimizer state\) of row 4 is not finite",
        ),
        "count": ({**moments, f"{NAME}.step": np.asarray(3.0)}, "a count of optimizer steps is"),
        "narrow": (
            {**moments, f"{NAME}.exp_avg": rows[:, :2].copy()},
            r"'user.weight.exp_avg' of shape \(11, 2\)",
        ),
    }
    for name, (state, says) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file({NAME: rows, **state}, str(path))
        tables = {NAME: Table(ROWS, DIM, init_from=str(path))}
        with (
            psworker.connect(addresses, mode="sync", timeout=10) as client,
            pytest.raises(InvalidRequestError, match=says) as info,
        ):
            client.init({}, psworker.Adam(lr=0.1), tables=tables)
        assert f"table '{NAME}': init_from '{path}'" in str(info.value)
        assert not any(s.initialized for s in shard_status(addresses, 5.0)), name  # no job
    # Another optimizer's state (no momentum_buffer in it): that one starts fresh.
    tables = {NAME: Table(ROWS, DIM, init_from=str(tmp_path / "nan.safetensors"))}
    with psworker.connect(addresses, mode="sync", timeout=10) as client:
        client.init({}, psworker.SGD(lr=1.0, momentum=0.9), tables=tables)
        client.push({NAME: RowSparse([2], np.ones((1, DIM), np.float32))})
        assert np.array_equal(client.pull_rows(NAME, [2, 3]), [[-1.0] * DIM, [0.0] * DIM])


def test_local_mode_reads_an_npy_file(tmp_path: Path) -> None:
    rows = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    np.save(tmp_path / "emb.npy", rows)
    with psworker.connect(mode="local") as client:
        table = Table(ROWS, DIM, init_from=str(tmp_path / "emb.npy"))
        client.init({}, psworker.SGD(lr=1.0), tables={"emb": table})
        assert np.array_equal(client.pull_rows("emb", [10, 0, 3]), rows[[10, 0, 3]])


def bad_files(tmp_path: Path) -> list[tuple[str, str]]:
    """(path, what the error says) for files that cannot be the table's rows."""
    good = np.zeros((ROWS, DIM), np.float32)
    nan = good.copy()
    nan[7, 1] = np.nan
    save_file({"other": good}, str(tmp_path / "other.safetensors"))
    save_file({NAME: good[:, :2].copy()}, str(tmp_path / "narrow.safetensors"))
    save_file({NAME: good.astype(np.float64)}, str(tmp_path / "double.safetensors"))
    np.save(tmp_path / "nan.npy", nan)
    (tmp_path / "torn.safetensors").write_bytes(b"not a safetensors file")
    return [
        (str(tmp_path / "missing.safetensors"), "could not be read on this host"),
        (str(tmp_path / "other.safetensors"), rf"holds no tensor '{NAME}'.*\['other'\]"),
        (str(tmp_path / "narrow.safetensors"), r"shape \(11, 2\) and dtype float32; .* \(11, 3\)"),
        (str(tmp_path / "double.safetensors"), r"dtype float64; the table is \(11, 3\) float32"),
        (str(tmp_path / "nan.npy"), "row 7 is not finite"),
        (str(tmp_path / "torn.safetensors"), "could not be read on this host"),
    ]


def test_a_file_that_cannot_be_the_tables_is_refused_and_changes_nothing(
    shards, tmp_path: Path
) -> None:
    folder = tmp_path / "tables"  # the shards read table files from here only
    folder.mkdir()
    addresses = [s.address for s in shards(2, Limits(table_files=str(folder)))]
    np.save(tmp_path / "elsewhere.npy", np.zeros((ROWS, DIM), np.float32))  # a good file
    (folder / "link.npy").symlink_to(tmp_path / "elsewhere.npy")
    outside = r"is outside the folder this shard reads table files from, '.*tables' \(psserver"
    cases = [(str(tmp_path / "elsewhere.npy"), outside), (str(folder / "link.npy"), outside)]
    for path, says in bad_files(folder) + cases:
        tables = {NAME: Table(ROWS, DIM, init_from=path)}
        with (
            psworker.connect(addresses, mode="sync", timeout=10) as client,
            pytest.raises(InvalidRequestError, match=says) as info,
        ):
            client.init({"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables=tables)
        assert f"table '{NAME}': init_from '{path}'" in str(info.value)
        assert info.value.status == "INVALID_ARGUMENT"
        assert not any(s.initialized for s in shard_status(addresses, 5.0)), path  # no job
    # The same shards then start the table from its seeded rows.
    with psworker.connect(addresses, mode="sync", timeout=10) as client:
        client.init(
            {"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables={NAME: Table(ROWS, DIM)}
        )
        assert client.pull_rows(NAME, [3]).shape == (1, DIM)


# -- dynamic tables ---------------------------------------------------------------------------

HASHED = "ctr.weight"
TOUCHED = np.array([7, -3, 2**40 + 1, 12, 99, 5], np.int64)  # pushed in this order


def dynamic_trained_and_exported(shards, path: Path, n: int = 2) -> np.ndarray:
    """Trains a dynamic table on ``n`` shards (rows TOUCHED) and exports it; returns the rows
    of TOUCHED. Row 12 is touched last (a zero gradient)."""
    addresses = [s.address for s in shards(n)]
    with psworker.connect(addresses, mode="async") as client:
        client.init(
            {"fc": np.ones(2, np.float32)},
            psworker.SGD(lr=0.5),
            tables={HASHED: Table(None, DIM, init="uniform", seed=4)},
        )
        grad = np.arange(len(TOUCHED) * DIM, dtype=np.float32).reshape(len(TOUCHED), DIM)
        client.push({HASHED: RowSparse(TOUCHED, grad)})
        rows = client.pull_rows(HASHED, TOUCHED)
        client.push({HASHED: RowSparse([12], np.zeros((1, DIM), np.float32))})
    export_state_dict(addresses, path, timeout=10)
    return rows


def test_a_dynamic_table_trained_on_two_shards_goes_on_from_three(shards, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    trained = dynamic_trained_and_exported(shards, path)
    with safe_open(str(path), framework="np") as f:
        assert sorted(f.get_tensor(HASHED + IDS_SUFFIX).tolist()) == sorted(TOUCHED.tolist())
        assert f.get_tensor(HASHED).shape == (len(TOUCHED), DIM)
    addresses = [s.address for s in shards(3, Limits(table_files=str(tmp_path)))]
    # Another seed: the file's rows are the trained ones, the others start from this one.
    tables = {HASHED: Table(None, DIM, seed=9, init_from=str(path))}
    fresh = np.array([1, 2**50], np.int64)
    with psworker.connect(addresses, mode="sync") as client:
        client.init({"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables=tables)
        path.unlink()  # read once, when the table was made: nothing later needs the file
        assert np.array_equal(client.pull_rows(HASHED, TOUCHED), trained)
        assert np.array_equal(
            client.pull_rows(HASHED, fresh), init_rows(fresh, DIM, "float32", "normal", 1.0, 9)
        )
        client.push({HASHED: RowSparse(TOUCHED[:3], np.ones((3, DIM), np.float32))})
        after = client.pull_rows(HASHED, TOUCHED)
        held = [t.rows for s in shard_status(addresses, 5.0) for t in s.tables]
    expected = trained.copy()
    expected[:3] -= 1.0
    assert np.array_equal(after, expected)
    assert sum(held) == len(TOUCHED) + len(fresh) and len(held) == 3 and min(held) >= 1


def test_a_dynamic_tables_file_keeps_its_least_recently_used_order(shards, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    trained = dynamic_trained_and_exported(shards, path, n=1)
    with safe_open(str(path), framework="np") as f:  # 12 was touched last
        assert f.get_tensor(HASHED + IDS_SUFFIX).tolist() == [7, -3, 2**40 + 1, 99, 5, 12]
    addresses = [s.address for s in shards(1, Limits(table_files=str(tmp_path)))]
    table = Table(None, DIM, capacity=len(TOUCHED), init_from=str(path))
    with psworker.connect(addresses, mode="sync") as client:
        client.init({}, psworker.SGD(lr=1.0), tables={HASHED: table})
        client.pull_rows(HASHED, [1000])  # a new row: the least recently used one, 7, goes
        again = client.pull_rows(HASHED, TOUCHED)
    assert not np.array_equal(again[0], trained[0])  # 7 came back from the seed
    assert np.array_equal(again[0], init_rows(TOUCHED[:1], DIM, "float32", "normal", 1.0, 0)[0])


def test_local_mode_reads_a_dynamic_tables_file(tmp_path: Path) -> None:
    ids = np.array([40, -2, 3], np.int64)
    rows = np.arange(len(ids) * DIM, dtype=np.float32).reshape(len(ids), DIM)
    save_file({"emb": rows, "emb" + IDS_SUFFIX: ids}, str(tmp_path / "emb.safetensors"))
    with psworker.connect(mode="local") as client:
        table = Table(None, DIM, init_from=str(tmp_path / "emb.safetensors"))
        client.init({}, psworker.SGD(lr=1.0), tables={"emb": table})
        assert np.array_equal(client.pull_rows("emb", [3, 40]), rows[[2, 0]])


def test_a_file_that_cannot_be_a_dynamic_tables_is_refused_and_changes_nothing(
    shards, tmp_path: Path
) -> None:
    addresses = [s.address for s in shards(2, Limits(table_files=str(tmp_path)))]
    ids = np.arange(6, dtype=np.int64) * 1000
    rows = np.ones((6, DIM), np.float32)
    nan = rows.copy()
    nan[4, 0] = np.inf
    files = {
        "no_ids": ({HASHED: rows}, rf"holds no tensor '{HASHED}.ids' \(the table's ids\)"),
        "twice": (
            {HASHED: rows, HASHED + IDS_SUFFIX: np.array([1, 2, 3, 2, 5, 6], np.int64)},
            r"id 2 is in 'ctr.weight.ids' 2 times",
        ),
        "short": (
            {HASHED: rows[:5].copy(), HASHED + IDS_SUFFIX: ids},
            r"shape \(5, 3\) and dtype float32; the table is \(6, 3\) float32",
        ),
        "float_ids": (
            {HASHED: rows, HASHED + IDS_SUFFIX: ids.astype(np.float64)},
            "holds float64 of shape",
        ),
        "nan": ({HASHED: nan, HASHED + IDS_SUFFIX: ids}, "row of id 4000 is not finite"),
    }
    cases = []
    for name, (tensors, says) in files.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        cases.append((Table(None, DIM, init_from=str(tmp_path / f"{name}.safetensors")), says))
    save_file({HASHED: rows, HASHED + IDS_SUFFIX: ids}, str(tmp_path / "good.safetensors"))
    full = Table(None, DIM, capacity=2, init_from=str(tmp_path / "good.safetensors"))
    cases.append((full, r"holds \d rows for shard \d of 2, over the table's capacity of 2"))
    for table, says in cases:
        with (
            psworker.connect(addresses, mode="sync", timeout=10) as client,
            pytest.raises(InvalidRequestError, match=says) as info,
        ):
            client.init(
                {"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables={HASHED: table}
            )
        assert f"table '{HASHED}': init_from '{table.init_from}'" in str(info.value)
        assert not any(s.initialized for s in shard_status(addresses, 5.0)), says


def test_only_a_file_a_table_can_read() -> None:
    with pytest.raises(psworker.ConfigError, match=r"a dynamic table's rows come from a file"):
        Table(None, DIM, init_from="rows.npy")
    with pytest.raises(psworker.ConfigError, match=r"'rows.pt': a fixed table's rows come from"):
        Table(ROWS, DIM, init_from="rows.pt")
    assert Table(ROWS, DIM, init_from="rows.npy").init_from == str(Path.cwd() / "rows.npy")
