"""Embedding tables, no network: seeded rows, placement, row storage, wire ids, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adagrad, Adam
from pscore.rowstore import RowStore
from pscore.tables import RowSparse, Table, TableSlice, init_rows, sum_duplicates
from psserver.checkpoint import Checkpointer
from psserver.records import Limits
from psserver.shard import Shard
from pswire.codec import ChunkAssembler
from pswire.errors import InvalidRequestError, ModelMismatchError
from pswire.proto import ps_pb2
from pswire.read import stream_request_parser
from pswire.write import encode_chunk_messages, tensor_to_chunks
from psworker.placement import TableLayout


def test_rows_are_a_function_of_seed_and_id_alone():
    ids = np.array([0, 5, -3, 2**63 - 1, 12345678901234])
    rows = init_rows(ids, 6, "float32", "normal", 1.0, 7)
    # The same id gives the same row whatever else is asked with it, in any order.
    assert np.array_equal(init_rows(ids[::-1], 6, "float32", "normal", 1.0, 7), rows[::-1])
    assert np.array_equal(init_rows(ids[2:3], 6, "float32", "normal", 1.0, 7)[0], rows[2])
    assert not np.array_equal(init_rows(ids, 6, "float32", "normal", 1.0, 8), rows)
    many = init_rows(np.arange(20_000), 32, "float32", "normal", 0.5, 0)
    assert abs(many.mean()) < 0.01 and abs(many.std() - 0.5) < 0.01
    uniform = init_rows(np.arange(20_000), 32, "float64", "uniform", 0.1, 0)
    assert uniform.dtype == np.float64 and uniform.min() >= -0.1 and uniform.max() < 0.1
    assert abs(uniform.std() - 0.1 / np.sqrt(3)) < 0.001
    assert not init_rows(ids, 3, "float32", "zeros", 1.0, 0).any()


def test_sum_duplicates_adds_rows_of_equal_ids_in_order():
    ids = np.array([4, 1, 4, 9, 1, 4])
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    unique, summed = sum_duplicates(ids, values)
    assert unique.tolist() == [1, 4, 9]
    assert summed.tolist() == [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]]


def test_layout_ranges_fixed_tables_and_hashes_dynamic_ones():
    fixed = TableLayout.build("e", Table(10, 2), 3)
    assert fixed.bounds == (0, 3, 7, 10)  # np.linspace, rounded
    assert fixed.shard_of(np.array([0, 2, 3, 6, 7, 9])).tolist() == [0, 0, 1, 1, 2, 2]
    assert [fixed.slice_for(s).local_rows for s in range(3)] == [3, 4, 3]
    with pytest.raises(InvalidRequestError, match=r"table 'e'.*id 10\b"):
        fixed.check_ids(np.array([1, 10]), "pull")
    dynamic = TableLayout.build("h", Table(None, 2), 4)
    owners = dynamic.shard_of(np.arange(-5000, 5000))
    assert np.bincount(owners, minlength=4).min() > 2200  # balanced, whatever the ids
    dynamic.check_ids(np.array([-(2**63), 2**63 - 1]), "pull")  # any int64 is an id


def test_table_and_slice_refuse_bad_settings_by_name():
    with pytest.raises(ValueError, match="capacity"):
        Table(10, 2, capacity=5)
    with pytest.raises(ValueError, match="dim"):
        Table(None, 0)
    spec = TableSlice("t", 2, num_rows=4, row_start=0, row_end=4)
    with pytest.raises(InvalidRequestError, match=r"table 't'.*weight_decay"):
        RowStore(spec, Adagrad(weight_decay=0.1))
    with pytest.raises(InvalidRequestError, match=r"table 't'.*\[3, 9\)"):
        TableSlice("t", 2, num_rows=4, row_start=3, row_end=9).check(SGD())


def test_fixed_store_applies_the_dense_optimizer_to_touched_rows_only():
    spec = TableSlice("t", 3, num_rows=6, row_start=2, row_end=6, init="uniform", seed=1)
    store = RowStore(spec, Adagrad(lr=0.1, initial_accumulator_value=0.2))
    dense = store.gather(np.arange(2, 6)).copy()  # rows are drawn on first touch
    state = Adagrad(lr=0.1, initial_accumulator_value=0.2).make_state(dense[[1, 3]])
    grad = np.array([[1, 2, 3], [4, 5, 6], [1, 1, 1]], dtype=np.float32)
    store.apply(np.array([5, 3, 5]), grad)  # id 5 twice: summed
    touched = dense[[1, 3]].copy()
    Adagrad(lr=0.1, initial_accumulator_value=0.2).apply(
        touched, np.array([[4, 5, 6], [2, 3, 4]], dtype=np.float32), state
    )
    held = store.export().values  # in id order (the store keeps rows in touch order)
    assert np.array_equal(held[[1, 3]], touched)
    assert np.array_equal(held[[0, 2]], dense[[0, 2]])
    assert np.array_equal(store.gather(np.array([2, 4])), dense[[0, 2]])


def test_row_ids_travel_in_the_first_chunk_like_protobuf():
    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    ids = np.array([9, -1, 2**40, 0, 3, 3])
    ours = list(encode_chunk_messages("e", values, 2, 40, indices=ids))
    theirs = [
        ps_pb2.PushRequest(chunk=c).SerializeToString()
        for c in tensor_to_chunks("e", values, 40, indices=ids)
    ]
    assert ours == theirs and len(ours) > 1
    parse = stream_request_parser(ps_pb2.PushHeader)
    assembler = ChunkAssembler()
    for message in ours:
        chunk = parse(message).chunk
        assert chunk is not None
        assembler.add(chunk)
    assert np.array_equal(assembler.finish()["e"], values)
    assert assembler.indices["e"].tolist() == ids.tolist()
    bad = ps_pb2.TensorChunk(
        name="e", dtype="float32", shape=[2, 2], total_bytes=16, data=bytes(16), indices=b"x"
    )
    with pytest.raises(InvalidRequestError, match=r"table 'e'.*8 bytes"):
        ChunkAssembler().add(bad)


def test_a_table_from_a_file_holds_its_rows_and_restores_without_the_file(tmp_path):
    whole = np.arange(24, dtype=np.float32).reshape(8, 3) / 10
    np.save(tmp_path / "emb.npy", whole)
    spec = TableSlice(
        "emb", 3, num_rows=8, row_start=4, row_end=8, init_from=str(tmp_path / "emb.npy")
    )
    job = Job(
        "async", 0, 1, Adam(lr=0.1), (VarSpec("emb", (4, 3), "float32", table=spec),), "digest"
    )
    shard = Shard(Limits(table_files=str(tmp_path)))
    shard.check_init(0, job)  # reads the file, holds nothing
    assert not shard.status().initialized
    shard.init(0, job, {})
    (tmp_path / "emb.npy").unlink()  # every row was read when the table was made
    rows, _ = shard.pull(0, 0, rows=[("emb", np.array([7, 4]))])
    assert np.array_equal(rows["emb"], whole[[7, 4]])
    shard.push(0, 0, {"emb": RowSparse([5], np.ones((1, 3), np.float32))})
    saved = tmp_path / "ckpt"
    path = Checkpointer(saved).save(shard.export_state())
    restored = Shard()  # its table files' folder is elsewhere: it reads none
    restored.restore(Checkpointer(saved).load(path))
    restored.check_init(0, job)  # holds values: reads no file
    restored.init(0, job, None)  # the same job, init_from and all
    ids = np.arange(4, 8)
    a, _ = shard.pull(0, 1, rows=[("emb", ids)])
    b, _ = restored.pull(0, 1, rows=[("emb", ids)])
    assert np.array_equal(a["emb"], b["emb"]) and not np.array_equal(a["emb"], whole[4:])
    with pytest.raises(InvalidRequestError, match=r"init_from '.*emb.npy' could not be read"):
        Shard(Limits(table_files=str(tmp_path))).check_init(0, job)


def test_checkpoint_round_trips_fixed_and_dynamic_tables(tmp_path):
    fixed = TableSlice("emb", 3, num_rows=8, row_start=4, row_end=8, init="uniform", seed=2)
    dynamic = TableSlice("hashed", 2, capacity=3, seed=5)
    job = Job(
        "async",
        0,
        1,
        Adam(lr=0.1),
        (
            VarSpec("w", (2,), "float32"),
            VarSpec("emb", (4, 3), "float32", table=fixed),
            VarSpec("hashed", (0, 2), "float32", table=dynamic),
        ),
        "digest",
    )
    shard = Shard()
    shard.init(0, job, {"w": np.ones(2, np.float32)})
    grads = {
        "w": np.ones(2, np.float32),
        "emb": RowSparse([5, 7], np.ones((2, 3), np.float32)),
        "hashed": RowSparse([10, 20, 30, 20], np.ones((4, 2), np.float32)),
    }
    shard.push(0, 0, grads)
    shard.pull(0, 1, rows=[("hashed", np.array([40]))])  # evicts 10, the oldest
    shard.pull(0, 1, rows=[("hashed", np.array([20]))])  # 20 becomes the newest
    state = shard.export_state()
    assert state is not None
    path = Checkpointer(tmp_path).save(state)

    restored = Shard()
    restored.restore(Checkpointer(tmp_path).load(path))
    for name, ids in (("emb", [4, 5, 6, 7]), ("hashed", [30, 40, 20])):
        a, _ = shard.pull(0, 1, rows=[(name, np.array(ids))])
        b, _ = restored.pull(0, 1, rows=[(name, np.array(ids))])
        assert np.array_equal(a[name], b[name])
    assert restored.status().tables["hashed"] == shard.status().tables["hashed"]
    assert restored.status().tables["hashed"][2] == 1  # evictions survive
    # The same next step gives the same rows and optimizer state on both.
    step = {"emb": RowSparse([4], np.full((1, 3), 2, np.float32))}
    shard.push(0, 1, step)
    restored.push(0, 1, step)
    a, _ = shard.pull(0, 2, rows=[("emb", np.arange(4, 8))])
    b, _ = restored.pull(0, 2, rows=[("emb", np.arange(4, 8))])
    assert np.array_equal(a["emb"], b["emb"])
    # LRU order survived too: a new id now evicts 30, the oldest.
    restored.pull(0, 2, rows=[("hashed", np.array([50]))])
    kept = restored.export_state()
    assert kept is not None and kept.tables["hashed"].ids is not None
    assert sorted(kept.tables["hashed"].ids.tolist()) == [20, 40, 50]


def test_a_worker_with_other_table_settings_is_told_what_differs():
    def job(seed: int) -> Job:
        table = TableSlice("emb", 3, num_rows=8, row_start=0, row_end=8, seed=seed)
        spec = VarSpec("emb", (8, 3), "float32", table=table)
        return Job("async", 0, 1, SGD(lr=0.1), (spec,), "digest")

    shard = Shard()
    shard.init(0, job(1), {})
    with pytest.raises(ModelMismatchError, match=r"variable 'emb'.*seed=1.*seed=2"):
        shard.init(0, job(2), None)


def test_row_sparse_refuses_ids_that_are_not_integers():
    with pytest.raises(
        InvalidRequestError, match=r"integers, got float64 \(e\.g\. np\.float64\(3\.7\)\)"
    ):
        RowSparse([3.7, 1.0], np.ones((2, 3), np.float32))
    assert RowSparse(np.array([3, 1], np.uint32), np.ones((2, 3))).ids.dtype == np.int64
    assert RowSparse([], np.ones((0, 3))).ids.shape == (0,)


@pytest.mark.parametrize("init", ["normal", "uniform"])
def test_rows_are_the_same_whatever_order_they_are_first_touched_in_and_after_a_restore(
    init: str,
) -> None:
    # A fixed slice keeps rows in the order they are first touched: what a row holds must not
    # depend on that order, nor on a checkpoint's round trip.
    spec = TableSlice("t", 5, num_rows=40, row_start=10, row_end=40, init=init, seed=3)
    ids = np.arange(10, 40)
    first, second = RowStore(spec, Adam(lr=0.1)), RowStore(spec, Adam(lr=0.1))
    for batch in (ids[::3], ids[::-2], ids):
        first.gather(batch)
    second.gather(ids[::-1])
    expected = init_rows(ids, 5, "float32", init, 1.0, 3)
    assert first.gather(ids).tobytes() == second.gather(ids).tobytes() == expected.tobytes()
    grad = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    for store in (first, second):
        assert store.apply(np.array([31, 12, 20]), grad)
    exported = [store.export() for store in (first, second)]
    assert exported[0].values.tobytes() == exported[1].values.tobytes()
    for key in ("exp_avg", "exp_avg_sq"):
        assert exported[0].slots[key].tobytes() == exported[1].slots[key].tobytes()
    restored = RowStore.restore(spec, Adam(lr=0.1), exported[0])
    assert restored.gather(ids).tobytes() == first.gather(ids).tobytes()
    assert restored.apply(np.array([12]), grad[:1]) and first.apply(np.array([12]), grad[:1])
    assert restored.export().values.tobytes() == first.export().values.tobytes()


def test_a_fixed_slice_untouched_until_export_exports_its_seeded_rows() -> None:
    spec = TableSlice("t", 4, num_rows=9, row_start=0, row_end=9, seed=2)
    store = RowStore(spec, SGD(lr=1.0, momentum=0.9))
    store.apply(np.array([7]), np.ones((1, 4), np.float32))
    state = store.export()
    expected = init_rows(np.arange(9), 4, "float32", "normal", 1.0, 2)
    expected[7] -= 1.0
    assert state.values.tobytes() == expected.tobytes()
    buffer = np.zeros((9, 4), np.float32)
    buffer[7] = 1.0
    assert state.slots["momentum_buffer"].tobytes() == buffer.tobytes()


def test_the_table_files_folder_is_a_psserver_flag_and_env(monkeypatch):
    from psserver.config import parse_config

    assert parse_config([]).limits.table_files == "."
    assert parse_config(["--table-files", "/data/tables"]).limits.table_files == "/data/tables"
    monkeypatch.setenv("PS_TABLE_FILES", "/mnt/t")
    assert parse_config([]).limits.table_files == "/mnt/t"
