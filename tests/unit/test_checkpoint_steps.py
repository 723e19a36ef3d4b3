"""Periodic checkpoints by steps land on multiples of N on every shard (not wherever a poller
found the clock), and a restore keeps workers that had left out of the quorum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.checkpoint import Checkpointer, CheckpointScheduler
from psserver.config import parse_config
from psserver.records import Limits
from psserver.shard import Shard

SPECS = (VarSpec("w", (3,), "float32"),)


def sync_shard(workers: int = 2) -> Shard:
    shard = Shard(Limits(max_wait_s=5))
    job = Job("sync", 0, workers, SGD(lr=1.0), SPECS, "m1")
    shard.init(0, job, {"w": np.zeros(3, np.float32)})
    for w in range(1, workers):
        shard.init(w, job, None)
    return shard


def steps(shard: Shard, first: int, count: int, workers: int = 2) -> None:
    for step in range(first, first + count):
        for w in range(workers):
            shard.push(w, step, {"w": np.ones(3, np.float32)})


def test_the_state_is_copied_exactly_at_each_multiple_and_written_once(tmp_path: Path) -> None:
    shard = sync_shard()
    # No periodic thread: the copies are taken by the shard itself, whenever a poll comes.
    saver = CheckpointScheduler(shard, Checkpointer(tmp_path, keep=10), every_steps=5)
    steps(shard, 0, 7)  # the clock went past 5 before anyone looked
    captured = shard.take_captured()
    assert captured is not None and captured.updates == 5
    assert captured.finished == {0: 5, 1: 5}
    np.testing.assert_array_equal(captured.variables["w"], np.full(3, -5.0, np.float32))
    assert shard.take_captured() is None  # handed over once
    steps(shard, 7, 6)  # clock 13: the copy at 10 waits for the writer
    saver.close()  # writes the copy at 10, then the final state at 13
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.safetensors"))
    assert [int(n[5:-12]) for n in names] == [10, 13]


def test_a_restored_shard_copies_at_the_next_multiple_not_at_its_own_clock(
    tmp_path: Path,
) -> None:
    shard = sync_shard()
    steps(shard, 0, 5)
    state = shard.export_state()
    assert state is not None
    again = Shard(Limits(max_wait_s=5))
    again.restore(state)
    again.capture_every(5)
    for w in range(2):
        again.init(w, state.job, None)
    steps(again, 5, 1)
    assert again.take_captured() is None
    steps(again, 6, 4)
    captured = again.take_captured()
    assert captured is not None and captured.updates == 10


def test_workers_that_left_stay_left_after_a_restore_from_the_file(tmp_path: Path) -> None:
    shard = sync_shard(3)
    steps(shard, 0, 2, workers=3)
    shard.leave(1)
    shard.leave(2)
    checkpointer = Checkpointer(tmp_path)
    state = shard.export_state()
    assert state is not None
    checkpointer.save(state)
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.left == [1, 2]
    again = Shard(Limits(max_wait_s=5))
    again.restore(loaded)
    status = again.status()
    assert status.live == frozenset({0}) and status.left == frozenset({1, 2})
    # A step needs only the worker still in the job...
    again.push(0, 2, {"w": np.ones(3, np.float32)})
    assert again.status().clock == 3
    # ...and one that comes back is counted again.
    again.init(1, state.job, None)
    assert 1 in again.status().live


def test_fresh_without_a_checkpoint_folder_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_config(["--fresh"])
    assert caught.value.code == 2
    assert "fresh sets aside the checkpoints of a checkpoint-dir" in capsys.readouterr().err
    assert parse_config(["--fresh", "--checkpoint-dir", "x"]).fresh


def test_set_aside_moves_every_checkpoint_and_deletes_none(tmp_path: Path) -> None:
    shard = sync_shard()
    checkpointer = Checkpointer(tmp_path, keep=5)
    for first in (0, 1):
        steps(shard, first, 1)
        state = shard.export_state()
        assert state is not None
        checkpointer.save(state)
    aside = checkpointer.set_aside()
    assert aside is not None and aside.parent == tmp_path
    assert sorted(p.name for p in aside.iterdir()) == [
        "ckpt-0000000001.safetensors",
        "ckpt-0000000002.safetensors",
    ]
    assert checkpointer.load_latest() is None and checkpointer.set_aside() is None
