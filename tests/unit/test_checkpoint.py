"""Checkpoint files: exact round trips, atomic replacement, falling back past corrupt files."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adagrad, Adam, Optimizer
from psserver.checkpoint import (
    Checkpointer,
    CheckpointScheduler,
    CorruptCheckpointError,
    checkpoint_name,
)
from psserver.records import Limits, ShardState
from psserver.shard import Shard
from pswire.errors import InvalidRequestError, ModelMismatchError, NotInitializedError

SPECS = (
    VarSpec("w", (3, 4), "float32"),
    VarSpec("emb/part0of2", (2, 5), "float64"),
    VarSpec("b", (), "float32"),
    VarSpec("buffer:bn.running_mean", (4,), "float32", average=True),
    VarSpec("buffer:bn.num_batches_tracked", (), "int64", average=True),
)
OPTIMIZERS: list[Optimizer] = [
    SGD(lr=0.1),
    SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    SGD(lr=0.05, momentum=0.5, dampening=0.1),
    Adam(lr=0.01, weight_decay=0.001),
    Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
]
MODES = [("sync", 0), ("async", 0), ("ssp", 1)]


def make_job(optimizer: Optimizer, mode: str = "sync", workers: int = 1, staleness: int = 0) -> Job:
    return Job(mode, staleness, workers, optimizer, SPECS, "digest-1")


def initial_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        v.key: rng.standard_normal(v.shape).astype(v.dtype)
        if v.dtype != "int64"
        else np.zeros(v.shape, np.int64)
        for v in SPECS
    }


def grads(step: int, worker: int) -> dict[str, np.ndarray]:
    """Deterministic per (step, worker): both shards of a comparison see the same pushes."""
    rng = np.random.default_rng(1000 * step + worker)
    out = {v.key: rng.standard_normal(v.shape).astype(v.dtype) for v in SPECS if not v.average}
    out["buffer:bn.running_mean"] = rng.standard_normal(4).astype(np.float32)
    out["buffer:bn.num_batches_tracked"] = np.array(step + 1, np.int64)
    return out


def ready(optimizer: Optimizer, mode: str = "sync", workers: int = 1, staleness: int = 0) -> Shard:
    shard = Shard(Limits(max_wait_s=5))
    assert shard.init(0, make_job(optimizer, mode, workers, staleness), initial_values())
    return shard


def train(shard: Shard, steps: range, workers: int) -> None:
    for step in steps:
        for worker in range(workers):
            result = shard.push(worker, step, grads(step, worker), timeout=5)
            assert result.applied, result


def assert_same_state(a: ShardState, b: ShardState) -> None:
    assert a.job == b.job
    assert (a.updates, a.finished, a.counters) == (b.updates, b.finished, b.counters)
    assert a.variables.keys() == b.variables.keys()
    for key, value in a.variables.items():
        assert value.dtype == b.variables[key].dtype
        assert value.shape == b.variables[key].shape
        assert value.tobytes() == b.variables[key].tobytes(), key  # bit-identical
    assert a.slots.keys() == b.slots.keys()
    for key, slots in a.slots.items():
        assert slots.keys() == b.slots[key].keys()
        for name, value in slots.items():
            other = b.slots[key][name]
            if isinstance(value, np.ndarray):
                assert isinstance(other, np.ndarray), (key, name)
                assert value.dtype == other.dtype
                assert value.tobytes() == other.tobytes(), (key, name)
            else:
                assert type(value) is type(other) and value == other, (key, name)


def exported(shard: Shard) -> ShardState:
    state = shard.export_state()
    assert state is not None
    return state


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: repr(o))
@pytest.mark.parametrize(("mode", "staleness"), MODES)
def test_restored_shard_continues_bit_identically(
    tmp_path: Path, optimizer: Optimizer, mode: str, staleness: int
) -> None:
    workers = 2
    original = ready(optimizer, mode, workers, staleness)
    train(original, range(3), workers)
    before = exported(original)
    path = Checkpointer(tmp_path).save(before, incarnation=original.incarnation)
    assert path.name == checkpoint_name(before.updates)

    restored = Shard(Limits(max_wait_s=5))
    state = Checkpointer(tmp_path).load_latest()
    assert state is not None
    assert_same_state(before, state)
    restored.restore(state)
    assert restored.status().checkpoint_step == before.updates

    train(original, range(3, 6), workers)
    train(restored, range(3, 6), workers)
    assert_same_state(exported(original), exported(restored))
    assert not np.array_equal(exported(restored).variables["w"], before.variables["w"])


def test_sgd_momentum_buffer_not_yet_made_round_trips_as_none(tmp_path: Path) -> None:
    shard = ready(SGD(lr=0.1, momentum=0.9))
    state = exported(shard)
    assert state.slots["w"] == {"momentum_buffer": None}
    Checkpointer(tmp_path).save(state)
    loaded = Checkpointer(tmp_path).load_latest()
    assert loaded is not None
    assert loaded.slots["w"] == {"momentum_buffer": None}
    assert_same_state(state, loaded)


def test_sync_checkpoint_mid_round_replays_the_open_step_identically(tmp_path: Path) -> None:
    optimizer = Adam(lr=0.01)
    original = ready(optimizer, "sync", workers=2)
    train(original, range(2), 2)
    assert original.push(0, 2, grads(2, 0), timeout=5).applied  # the round for step 2 is open
    state = exported(original)
    assert state.finished == {0: 2, 1: 2}, "the open round's push is not in the checkpoint"
    Checkpointer(tmp_path).save(state)

    restored = Shard(Limits(max_wait_s=5))
    loaded = Checkpointer(tmp_path).load_latest()
    assert loaded is not None
    restored.restore(loaded)
    # Worker 0 re-sends its step-2 push to the restored shard (it was not durable).
    assert restored.push(0, 2, grads(2, 0), timeout=5).applied
    for shard in (original, restored):
        assert shard.push(1, 2, grads(2, 1), timeout=5).applied
    assert original.snapshot()["w"].tobytes() == restored.snapshot()["w"].tobytes()
    assert exported(restored).updates == 3


def test_metadata_records_job_clocks_and_incarnation(tmp_path: Path) -> None:
    shard = ready(Adam(lr=0.01))
    train(shard, range(2), 1)
    path = Checkpointer(tmp_path).save(exported(shard), incarnation=shard.incarnation)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["psgrpc.state"])
        names = set(f.keys())
    assert meta["version"] == 1 and meta["incarnation"] == shard.incarnation
    assert meta["updates"] == 2 and meta["finished"] == {"0": 2}
    assert meta["job"]["optimizer"] == {"name": "adam", "params": Adam(lr=0.01).params()}
    assert meta["slot_values"]["w"] == {"step": 2}
    assert {"var/w", "slot/w/exp_avg", "slot/emb/part0of2/exp_avg_sq"} <= names
    assert "slot/buffer:bn.running_mean/exp_avg" not in names


def test_keep_prunes_to_the_newest_and_leaves_no_temp_files(tmp_path: Path) -> None:
    shard = ready(SGD(lr=0.1, momentum=0.9))
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(5):
        train(shard, range(step, step + 1), 1)
        ckpt.save(exported(shard))
    assert [p.name for p in ckpt.paths()] == [checkpoint_name(5), checkpoint_name(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(4), checkpoint_name(5)]


def test_saving_the_same_clock_twice_replaces_the_file(tmp_path: Path) -> None:
    shard = ready(SGD(lr=0.1))
    ckpt = Checkpointer(tmp_path, keep=3)
    first = ckpt.save(exported(shard))
    second = ckpt.save(exported(shard))
    assert first == second and ckpt.paths() == [first]


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes: only the digest notices
    path.write_bytes(bytes(data))


def corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"\x00" * 5)


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate, corrupt_garbage])
def test_corrupt_newest_falls_back_to_previous_good(
    tmp_path: Path, damage, caplog: pytest.LogCaptureFixture
) -> None:
    shard = ready(Adagrad(lr=0.1))
    ckpt = Checkpointer(tmp_path)
    train(shard, range(2), 1)
    good = exported(shard)
    ckpt.save(good)
    train(shard, range(2, 3), 1)
    newest = ckpt.save(exported(shard))
    damage(newest)
    with pytest.raises(CorruptCheckpointError):
        ckpt.load(newest)
    with caplog.at_level(logging.ERROR, logger="psserver.checkpoint"):
        loaded = ckpt.load_latest()
    assert loaded is not None
    assert_same_state(good, loaded)
    assert newest.name in caplog.text


def test_no_checkpoint_gives_none_and_only_corrupt_ones_are_refused(tmp_path: Path) -> None:
    assert Checkpointer(tmp_path / "missing").load_latest() is None
    assert Checkpointer(tmp_path).load_latest() is None
    (tmp_path / checkpoint_name(7)).write_bytes(b"not a checkpoint")
    with pytest.raises(CorruptCheckpointError, match=r"1 checkpoint file\(s\) and none is valid"):
        Checkpointer(tmp_path).load_latest()


def rewrite(path: Path, edit_meta=None, edit_tensors=None) -> None:
    """Rewrites a checkpoint with altered contents and a digest that matches them again,
    so only the consistency checks stand between it and a restore."""
    from psserver import checkpoint_codec as module

    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["psgrpc.state"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    text = json.dumps(meta)
    digest = module.digest(text, tensors)
    safetensors.numpy.save_file(
        tensors, str(path), metadata={"psgrpc.state": text, "psgrpc.sha256": digest}
    )


def _set(path: list, value):
    def edit(doc):
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit_meta", "edit_tensors", "message"),
    [
        (_set(["version"], 99), None, "version 99"),
        (_set(["job", "variables", 0, "shape"], [4, 3]), None, "shape"),
        (_set(["job", "variables", 0, "dtype"], "complex64"), None, "unsupported dtype"),
        (_set(["job", "mode"], "gossip"), None, "unknown mode"),
        (_set(["job", "optimizer", "name"], "lamb"), None, "unknown optimizer"),
        (_set(["slot_values", "w"], {}), None, "optimizer slots"),
        (None, lambda t: t.pop("slot/w/exp_avg"), "slot/w/exp_avg"),
        (None, lambda t: t.update(stray=np.zeros(1, np.float32)), "stray"),
        (None, lambda t: t.update({"var/w": t["var/w"].astype(np.float64)}), "dtype"),
    ],
)
def test_metadata_mismatch_is_rejected_and_skipped(
    tmp_path: Path, edit_meta, edit_tensors, message: str
) -> None:
    shard = ready(Adam(lr=0.01))
    ckpt = Checkpointer(tmp_path)
    train(shard, range(1), 1)
    good = exported(shard)
    ckpt.save(good)
    train(shard, range(1, 2), 1)
    newest = ckpt.save(exported(shard))
    rewrite(newest, edit_meta, edit_tensors)
    with pytest.raises(CorruptCheckpointError, match=message):
        ckpt.load(newest)
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded.updates == good.updates


def test_failed_write_keeps_the_previous_checkpoint_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = ready(SGD(lr=0.1))
    ckpt = Checkpointer(tmp_path)
    good = ckpt.save(exported(shard))
    train(shard, range(1), 1)

    def torn_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", torn_write)
    with pytest.raises(OSError, match="No space"):
        ckpt.save(exported(shard))
    assert sorted(tmp_path.iterdir()) == [good]
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded.updates == 0


def test_lock_claims_the_directory_and_clears_stale_temp_files(tmp_path: Path) -> None:
    stale = tmp_path / ".ckpt-abc.tmp"
    stale.write_bytes(b"left by kill -9")
    first = Checkpointer(tmp_path)
    first.lock()
    assert not stale.exists()
    with pytest.raises(RuntimeError, match="in use by another process"):
        Checkpointer(tmp_path).lock()
    first.unlock()
    second = Checkpointer(tmp_path)
    second.lock()
    second.unlock()


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)


# -- scheduler ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_scheduler_checkpoint_on_demand_marks_the_shard(tmp_path: Path) -> None:
    shard = Shard(Limits(max_wait_s=5))
    saver = CheckpointScheduler(shard, Checkpointer(tmp_path))
    with pytest.raises(NotInitializedError, match="nothing to checkpoint"):
        saver.checkpoint()
    shard.init(0, make_job(SGD(lr=0.1)), initial_values())
    train(shard, range(2), 1)
    path, step = saver.checkpoint()
    assert (Path(path).name, step) == (checkpoint_name(2), 2)
    assert shard.status().checkpoint_step == 2
    assert shard.register_worker(0, 1).durable_step == 2


def test_scheduler_saves_every_n_steps_and_on_close_only_when_changed(tmp_path: Path) -> None:
    shard = ready(SGD(lr=0.1))
    ckpt = Checkpointer(tmp_path)
    saver = CheckpointScheduler(shard, ckpt, every_steps=2, poll_s=0.01)
    saver.start()
    try:
        train(shard, range(2), 1)
        wait_for(lambda: ckpt.paths() and ckpt.paths()[0].name == checkpoint_name(2))
        train(shard, range(2, 3), 1)
    finally:
        final = saver.close(timeout=5)
    assert final is not None and final.name == checkpoint_name(3)
    assert saver.close(timeout=5) is None, "nothing changed since: no second final save"


def test_scheduler_time_rule_saves_only_after_a_change(tmp_path: Path) -> None:
    clock = FakeClock()
    shard = ready(SGD(lr=0.1))
    ckpt = Checkpointer(tmp_path)
    saver = CheckpointScheduler(shard, ckpt, every_secs=10, poll_s=0.01, clock=clock)
    saver.checkpoint()  # the initial values
    saver.start()
    try:
        clock.now = 11.0
        assert not wait_for(lambda: len(ckpt.paths()) > 1, timeout=0.3), "unchanged: no save"
        train(shard, range(1), 1)
        assert wait_for(lambda: ckpt.paths()[0].name == checkpoint_name(1))
    finally:
        saver.close(timeout=5)


def test_scheduler_survives_a_failing_disk(tmp_path: Path, monkeypatch) -> None:
    shard = ready(SGD(lr=0.1))
    ckpt = Checkpointer(tmp_path)
    failures = threading.Event()

    def failing_save(state, incarnation=""):
        failures.set()
        raise OSError(5, "I/O error")

    monkeypatch.setattr(ckpt, "save", failing_save)
    saver = CheckpointScheduler(shard, ckpt, every_steps=1, poll_s=0.01)
    saver.start()
    try:
        train(shard, range(1), 1)
        assert failures.wait(5)
        with pytest.raises(Exception, match="I/O error"):
            saver.checkpoint()
        train(shard, range(1, 2), 1)  # the shard keeps serving
    finally:
        assert saver.close(timeout=5) is None
    assert shard.status().checkpoint_step == -1


def wait_for(condition, timeout: float = 5.0) -> bool:
    """Polls ``condition`` until it holds or ``timeout`` passes; returns whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def test_files_are_fsynced_before_the_rename(tmp_path: Path, monkeypatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1]
    )
    Checkpointer(tmp_path).save(exported(ready(SGD(lr=0.1))))
    assert calls == ["fsync", "replace", "fsync"]  # file, rename, directory


@pytest.mark.parametrize(
    ("shard", "num_shards", "named"),
    [(0, 1, "shard 0 of 1"), (0, 3, "shard 0 of 3"), (1, 2, "shard 1 of 2")],
)
def test_a_checkpoint_keeps_the_shards_place_and_a_restore_elsewhere_is_refused(
    tmp_path: Path, shard: int, num_shards: int, named: str
) -> None:
    job = dataclasses.replace(make_job(SGD(lr=0.1)), shard=0, num_shards=2)
    trained = Shard(Limits(max_wait_s=5))
    assert trained.init(0, job, initial_values())
    train(trained, range(2), 1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(exported(trained))
    state = ckpt.load_latest()
    assert state is not None and (state.job.shard, state.job.num_shards) == (0, 2)
    restored = Shard(Limits(max_wait_s=5))
    restored.restore(state)
    other = dataclasses.replace(job, shard=shard, num_shards=num_shards)
    with pytest.raises(ModelMismatchError, match=rf"shard 0 of 2 shards, the worker sent {named}"):
        restored.init(0, other, initial_values())
    assert restored.status().clock == 2  # nothing changed
    assert not restored.init(0, job, None)  # the same place is taken, values kept
    # A job that does not say (an older client or checkpoint) is not checked.
    assert not restored.init(0, dataclasses.replace(job, shard=0, num_shards=0), None)


def test_a_shard_outside_the_count_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="shard 2 of 2"):
        dataclasses.replace(make_job(SGD(lr=0.1)), shard=2, num_shards=2).check(4, 100)
