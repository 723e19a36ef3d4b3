"""Damaged-but-signed checkpoints: optimizer slots of the wrong shape, dtype or kind, sealed
with a digest that matches, are refused at load and the next older checkpoint is used, rather
than loaded to crash (or silently misbehave) on the first push."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from pscore.job import Job, VarSpec
from pscore.optim import SGD, Adam, Optimizer
from pscore.tables import RowSparse, TableSlice
from psserver import checkpoint_codec
from psserver.checkpoint import Checkpointer, CorruptCheckpointError
from psserver.records import Limits
from psserver.shard import Shard

TABLE = TableSlice("emb", 3, num_rows=4, row_start=0, row_end=4, seed=1)
SPECS = (VarSpec("w", (3, 4), "float32"), VarSpec("emb", (4, 3), "float32", table=TABLE))
Edit = Callable[[dict, dict], None]  # (the JSON state, the tensors by name), changed in place


def trained(optimizer: Optimizer, steps: int) -> Shard:
    shard = Shard(Limits(max_wait_s=5))
    job = Job("async", 0, 1, optimizer, SPECS, "m")
    assert shard.init(0, job, {"w": np.zeros((3, 4), np.float32)})
    for step in range(steps):
        grads = {
            "w": np.full((3, 4), step + 1, np.float32),
            "emb": RowSparse([1, 2], np.ones((2, 3), np.float32)),
        }
        assert shard.push(0, step, grads).applied
    return shard


def save_two(tmp_path: Path, optimizer: Optimizer) -> tuple[Checkpointer, int, Path]:
    """An older good checkpoint (clock 1) and a newer one (clock 2); returns the newer."""
    shard = trained(optimizer, 1)
    ckpt = Checkpointer(tmp_path)
    state = shard.export_state()
    assert state is not None
    ckpt.save(state)
    shard.push(0, 1, {"w": np.ones((3, 4), np.float32)})
    newest = shard.export_state()
    assert newest is not None and newest.updates == 2
    return ckpt, state.updates, ckpt.save(newest)


def reseal(path: Path, edit: Edit) -> None:
    """Rewrites a checkpoint with ``edit`` applied and a digest that matches the result."""
    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["psgrpc.state"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(meta, tensors)
    text = json.dumps(meta)
    sealed = {"psgrpc.state": text, "psgrpc.sha256": checkpoint_codec.digest(text, tensors)}
    safetensors.numpy.save_file(tensors, str(path), metadata=sealed)


def tensor(name: str, change: Callable[[np.ndarray], np.ndarray]) -> Edit:
    def edit(meta: dict, tensors: dict) -> None:
        tensors[name] = np.ascontiguousarray(change(tensors[name]))

    return edit


def slot_value(key: str, slot: str, value: object) -> Edit:
    def edit(meta: dict, tensors: dict) -> None:
        meta["slot_values"][key][slot] = value

    return edit


def step_as_an_array(meta: dict, tensors: dict) -> None:
    step = meta["slot_values"]["w"].pop("step")
    meta["slot_arrays"]["w"].append("step")
    tensors["slot/w/step"] = np.full((3, 4), step, np.float32)


ADAM = Adam(lr=0.1)
MOMENTUM = SGD(lr=0.1, momentum=0.9)
CASES = [
    (ADAM, tensor("slot/w/exp_avg", lambda a: a.T), "shape"),
    (ADAM, tensor("slot/w/exp_avg", lambda a: a.reshape(-1)), "shape"),
    (ADAM, tensor("slot/w/exp_avg_sq", lambda a: a.astype(np.float64)), "dtype"),
    (ADAM, tensor("slot/w/exp_avg_sq", lambda a: np.full_like(a, np.nan)), "non-finite"),
    (ADAM, slot_value("w", "step", 1.5), "step"),
    (ADAM, slot_value("w", "step", None), "step"),
    (ADAM, step_as_an_array, "step"),
    (ADAM, tensor("table/emb/slot/exp_avg", lambda a: a[:2]), "shape"),
    (ADAM, tensor("table/emb/slot/exp_avg", lambda a: a.astype(np.float16)), "dtype"),
    (MOMENTUM, tensor("slot/w/momentum_buffer", lambda a: a[:, :2]), "shape"),
    (MOMENTUM, tensor("slot/w/momentum_buffer", lambda a: a.astype(np.int32)), "dtype"),
]


@pytest.mark.parametrize(("optimizer", "edit", "message"), CASES)
def test_a_signed_checkpoint_with_bad_slots_is_refused_and_the_older_one_used(
    tmp_path: Path, optimizer: Optimizer, edit: Edit, message: str
) -> None:
    ckpt, good_clock, newest = save_two(tmp_path, optimizer)
    reseal(newest, lambda meta, tensors: None)
    assert ckpt.load(newest).updates == 2  # resealing alone leaves a good checkpoint
    reseal(newest, edit)
    with pytest.raises(CorruptCheckpointError, match=message):
        ckpt.load(newest)
    state = ckpt.load_latest()
    assert state is not None and state.updates == good_clock
    shard = Shard(Limits(max_wait_s=5))
    shard.restore(state)  # and the shard it makes trains on
    grads = {"w": np.ones((3, 4), np.float32), "emb": RowSparse([0], np.ones((1, 3), np.float32))}
    assert shard.push(0, good_clock, grads).applied
