"""psctl's admin calls against in-process shards: checkpoint every shard, export a state_dict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import psworker
from pscore.tables import RowSparse, Table, init_rows
from psctl.admin import checkpoint_all, export_state_dict
from psserver.checkpoint import Checkpointer, CheckpointScheduler
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.errors import ModelMismatchError, NotInitializedError, PSError


@pytest.fixture
def checkpointed(tmp_path: Path):
    """Factory: n shard servers, each with its own checkpoint directory."""
    started: list[RunningServer] = []

    def make(n: int) -> list[RunningServer]:
        for i in range(n):
            shard = Shard()
            saver = CheckpointScheduler(shard, Checkpointer(tmp_path / f"shard{i}"))
            started.append(start_server(shard, checkpoint=saver.checkpoint))
        return started

    yield make
    for server in started:
        server.stop(grace=0.5)


def train_two_steps(addresses: list[str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    model = {
        "emb.weight": rng.standard_normal((40, 8)).astype(np.float32),
        "fc.bias": np.zeros(8, np.float32),
        "buffer:bn.running_mean": np.zeros(8, np.float32),
    }
    with psworker.connect(addresses, worker_id=0, num_workers=1, split_bytes=512) as client:
        client.init(model, psworker.Adam(lr=0.01), buffers=["buffer:bn.running_mean"])
        for _ in range(2):
            grads = {k: np.ones_like(v) for k, v in model.items()}
            client.push(grads)
        assert client.shard_map is not None
        assert any("/part" in p.key for p in client.shard_map.pieces), "emb.weight is split"
        return client.pull()


def test_checkpoint_all_saves_on_every_shard(checkpointed, tmp_path: Path) -> None:
    addresses = [s.address for s in checkpointed(2)]
    train_two_steps(addresses)
    saved = checkpoint_all(addresses, timeout=10)
    assert [s.address for s in saved] == addresses
    assert [s.step for s in saved] == [2, 2]
    for i, s in enumerate(saved):
        assert Path(s.path).parent == tmp_path / f"shard{i}"
        state = Checkpointer(tmp_path / f"shard{i}").load(s.path)
        assert state.updates == 2


def test_checkpoint_all_names_each_shard_that_cannot(shards) -> None:
    addresses = [s.address for s in shards(2)]
    with pytest.raises(PSError, match="--checkpoint-dir") as info:
        checkpoint_all(addresses, timeout=10)
    assert all(a in str(info.value) for a in addresses)
    assert info.value.status == "FAILED_PRECONDITION"


def test_export_writes_a_state_dict_that_loads_into_the_module(shards, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    addresses = [s.address for s in shards(2)]
    pulled = train_two_steps(addresses)
    done = export_state_dict(addresses, tmp_path / "model.pt", timeout=10)
    assert (done.path, done.format, done.clocks) == (tmp_path / "model.pt", "torch", [2, 2])
    state = torch.load(done.path, weights_only=True)
    assert sorted(state) == ["bn.running_mean", "emb.weight", "fc.bias"]
    for name, value in pulled.items():
        assert torch.equal(state[name.removeprefix("buffer:")], torch.tensor(value)), name
    module = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(40, 8),
            "fc": torch.nn.Linear(8, 8),
            "bn": torch.nn.BatchNorm1d(8),
        }
    )
    missing, _ = module.load_state_dict(state, strict=False)
    assert "emb.weight" not in missing and "bn.running_mean" not in missing
    assert torch.equal(module["emb"].weight.detach(), torch.tensor(pulled["emb.weight"]))


def test_export_before_init_and_across_models_fails(shards, tmp_path: Path) -> None:
    addresses = [s.address for s in shards(2)]
    with pytest.raises(NotInitializedError, match="nothing to export"):
        export_state_dict(addresses, tmp_path / "m.pt", timeout=10)
    other = [s.address for s in shards(1)]
    train_two_steps(addresses)
    with psworker.connect(other, worker_id=0, num_workers=1) as client:
        client.init({"x": np.zeros(3, np.float32)}, psworker.SGD(lr=0.1))
    with pytest.raises(ModelMismatchError, match="different models"):
        export_state_dict([addresses[0], other[0]], tmp_path / "m.pt", timeout=10)
    assert not (tmp_path / "m.pt").exists()


def test_export_writes_fixed_tables_whole_and_dynamic_ones_with_their_ids(
    shards, tmp_path: Path
) -> None:
    addresses = [s.address for s in shards(2)]
    tables = {"user.weight": Table(7, 3, init="uniform"), "hashed": Table(None, 2)}
    with psworker.connect(addresses, mode="async") as client:
        client.init({"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables=tables)
        client.push({"user.weight": RowSparse([0, 6], np.ones((2, 3), np.float32))})
        hashed = client.pull_rows("hashed", [5, -8])  # both on shard 0: shard 1 sends none
        expected = client.pull_rows("user.weight", np.arange(7))
    done = export_state_dict(addresses, tmp_path / "model.safetensors", timeout=10)
    assert sorted(done.tensors) == ["fc", "hashed", "hashed.ids", "user.weight"]
    assert np.array_equal(done.tensors["user.weight"], expected)
    order = np.argsort(done.tensors["hashed.ids"])
    assert done.tensors["hashed.ids"][order].tolist() == [-8, 5]
    assert np.array_equal(done.tensors["hashed"][order], hashed[::-1])
    assert expected[0, 0] != init_rows(np.arange(1), 3, "float32", "uniform", 1.0, 0)[0, 0]


def test_a_raw_every_row_query_is_refused_where_it_cannot_be_read(shards) -> None:
    """Every row (``RowQuery.every``) is a Pull's, of a dynamic table, without ids: anything
    else is INVALID_ARGUMENT naming the table, and reads nothing."""
    import grpc

    from pswire.proto import ps_pb2, ps_pb2_grpc

    (server,) = shards(1)
    tables = {"user.weight": Table(7, 3), "hashed": Table(None, 2)}
    with psworker.connect([server.address], mode="async") as client:
        client.init({"fc": np.ones(2, np.float32)}, psworker.SGD(lr=1.0), tables=tables)
        client.pull_rows("hashed", [5])
    every = ps_pb2.RowQuery(table="hashed", every=True)
    cases = [
        (ps_pb2.RowQuery(table="user.weight", every=True), "table 'user.weight', which is fixed"),
        (ps_pb2.RowQuery(table="hashed", every=True, ids=b"\0" * 8), "names ids and asks for"),
    ]
    with grpc.insecure_channel(server.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for query, says in cases:
            request = ps_pb2.PullRequest(worker_id=-1, step=0, rows=[query])
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Pull(request, timeout=5))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, says
            assert says in info.value.details()
        step = ps_pb2.PushPullRequest(
            header=ps_pb2.PushHeader(worker_id=0, step=1, skip=True), rows=[every]
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.PushPull(step, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "table 'hashed': every row a shard holds" in info.value.details()
        slots = ps_pb2.RowQuery(table="user.weight", ids=b"\0" * 8, slots=True)
        step.rows[0].CopyFrom(slots)  # the rows' optimizer state: an export's, not a step's
        with pytest.raises(grpc.RpcError) as info:
            stub.PushPull(step, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "table 'user.weight': the rows' optimizer state" in info.value.details()
        (reply,) = stub.Pull(ps_pb2.PullRequest(worker_id=-1, step=0, rows=[every]), timeout=5)
    assert np.frombuffer(reply.chunk.indices, "<i8").tolist() == [5]
