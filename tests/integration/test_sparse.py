"""Embedding tables on real shards: sparse sync equals dense local, bad input, LRU, modes."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from workers import run_workers  # noqa: E402

import psworker  # noqa: E402
from pscore.tables import RowSparse, Table, init_rows  # noqa: E402
from pswire.errors import InvalidRequestError, UnknownVariableError  # noqa: E402
from pswire.proto import ps_pb2  # noqa: E402
from pswire.write import push_stream  # noqa: E402
from psworker.torch import DistributedOptimizer, Embedding, EmbeddingBag  # noqa: E402

ROWS, DIM, STEPS, BATCH, BAG = 50, 4, 30, 6, 3


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # Ids skewed towards a few rows, so both workers often touch the same rows (and many
    # rows only one worker or neither touches in a step); the last 5 rows are never used.
    ids = (torch.rand(n, BAG, generator=g) ** 2 * (ROWS - 5)).long()
    return ids, torch.randn(n, 1, generator=g)


class Net(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Module, bag: bool) -> None:
        super().__init__()
        self.embedding = embedding
        self.bag = bag
        self.head = torch.nn.Linear(DIM, 1)
        # Not torch.manual_seed: workers build their nets in threads at once.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, DIM, generator=g))
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bag:
            return self.head(self.embedding(ids))
        return self.head(self.embedding(ids).mean(dim=1))


def dense_embedding(bag: bool) -> torch.nn.Module:
    """torch's own module, starting from the rows the shards make (seed 0, normal)."""
    module = torch.nn.EmbeddingBag(ROWS, DIM, mode="mean") if bag else torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        module.weight.copy_(
            torch.from_numpy(init_rows(np.arange(ROWS), DIM, "float32", "normal", 1.0, 0))
        )
    return module


def train(opt: DistributedOptimizer, ids, y, lo, hi) -> None:
    for t in range(STEPS):
        opt.zero_grad()
        a, b = lo(t), hi(t)
        torch.nn.functional.mse_loss(opt.model(ids[a:b]), y[a:b]).backward()
        opt.step()


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
@pytest.mark.parametrize(
    "optimizer", [psworker.SGD(lr=0.5), psworker.Adagrad(lr=0.3)], ids=["sgd", "adagrad"]
)
def test_sparse_sync_two_workers_equal_dense_local_with_the_combined_batch(shards, optimizer, bag):
    ids, y = data(STEPS * 2 * BATCH)
    with psworker.connect(mode="local") as local:
        reference = Net(dense_embedding(bag), bag)
        opt = DistributedOptimizer(reference, local, optimizer)
        train(opt, ids, y, lambda t: 2 * BATCH * t, lambda t: 2 * BATCH * (t + 1))
        expected = reference.embedding.weight.detach().numpy().copy()
        expected_head = reference.head.weight.detach().numpy().copy()

    addrs = [s.address for s in shards(2)]
    got: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def worker(i: int):
        def run():
            with psworker.connect(addrs, worker_id=i, num_workers=2, mode="sync") as client:
                cls = EmbeddingBag if bag else Embedding
                net = Net(cls(ROWS, DIM, client, name="emb"), bag)
                opt = DistributedOptimizer(net, client, optimizer)
                lo = lambda t: 2 * BATCH * t + i * BATCH  # noqa: E731
                train(opt, ids, y, lo, lambda t: lo(t) + BATCH)
                table = client.pull_rows("emb", np.arange(ROWS))
                got[i] = table, net.head.weight.detach().numpy().copy()

        return run

    run_workers([worker(0), worker(1)])
    for i in (0, 1):
        table, head = got[i]
        assert np.abs(table - expected).max() < 1e-5
        assert np.abs(head - expected_head).max() < 1e-5
    # The test means something only if training moved the rows it used, and no others.
    start = init_rows(np.arange(ROWS), DIM, "float32", "normal", 1.0, 0)
    moved = np.abs(expected - start).max(axis=1) > 0
    assert moved[: ROWS - 5].sum() > ROWS // 2 and not moved[ROWS - 5 :].any()


def test_lazy_adam_moves_only_touched_rows_like_sparse_adam(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], mode="async") as client:
        client.init({}, psworker.Adam(lr=0.1), tables={"t": Table(8, 2, init="zeros")})
        weight = torch.nn.Parameter(torch.zeros(8, 2))
        sparse_adam = torch.optim.SparseAdam([weight], lr=0.1)
        g = np.random.default_rng(0)
        for _ in range(5):
            ids = g.integers(0, 4, size=3)  # rows 4..7 never touched
            grad = g.normal(size=(3, 2)).astype(np.float32)
            client.push({"t": RowSparse(ids, grad)})
            dense_ids = torch.from_numpy(ids).reshape(1, -1)
            weight.grad = torch.sparse_coo_tensor(
                dense_ids, torch.from_numpy(grad), (8, 2), check_invariants=True
            )
            sparse_adam.step()
        rows = client.pull_rows("t", np.arange(8))
    assert np.abs(rows - weight.detach().numpy()).max() < 1e-6
    assert not rows[4:].any()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("name", ["adam", "adagrad"])
def test_a_step_counts_for_the_whole_table_on_any_shard_count(shards, n, dynamic, name):
    """torch steps a sparse parameter once per step whatever its rows (SparseAdam's bias
    correction, Adagrad's lr_decay count those steps): so does every shard's slice, also one
    whose rows a step did not touch. It used to count only its own touches, and a table on
    two shards trained another model than on one."""
    scale = 1_000_003 if dynamic else 1
    touches = [[1, 7], [1], [1], [7], [5], [7, 1, 2], [2]]  # a step on one shard's rows only
    g = np.random.default_rng(5)
    grads = [g.normal(size=(len(t), 2)).astype(np.float32) for t in touches]
    ours, theirs = {
        "adam": (psworker.Adam(lr=0.1), lambda w: torch.optim.SparseAdam([w], lr=0.1)),
        "adagrad": (
            psworker.Adagrad(lr=0.5, lr_decay=0.3),
            lambda w: torch.optim.Adagrad([w], lr=0.5, lr_decay=0.3),
        ),
    }[name]
    weight = torch.nn.Parameter(torch.zeros(8, 2))
    reference = theirs(weight)
    for ids, grad in zip(touches, grads, strict=True):
        index = torch.tensor([ids])
        weight.grad = torch.sparse_coo_tensor(index, torch.from_numpy(grad), (8, 2))
        reference.step()
    table = Table(None if dynamic else 8, 2, init="zeros")
    addresses = [s.address for s in shards(n)]
    with psworker.connect(addresses, mode="sync") as client:
        client.init({}, ours, tables={"t": table})
        for ids, grad in zip(touches, grads, strict=True):
            client.push({"t": RowSparse(np.array(ids) * scale, grad)})
        rows = client.pull_rows("t", np.arange(8) * scale)
    assert np.abs(rows - weight.detach().numpy()).max() < 1e-6


def test_bad_rows_are_refused_by_name_and_change_nothing(shards):
    (server,) = shards(1)
    with psworker.connect([server.address], mode="async") as client:
        client.init(
            {"w": np.zeros(2, np.float32)}, psworker.SGD(lr=1.0), tables={"emb": Table(10, 3)}
        )
        before = client.pull_rows("emb", np.arange(10))
        with pytest.raises(InvalidRequestError, match=r"table 'emb'.*id 10\b"):
            client.pull_rows("emb", [3, 10])
        with pytest.raises(InvalidRequestError, match=r"table 'emb'.*id -1\b"):
            client.push({"emb": RowSparse([1, -1], np.ones((2, 3), np.float32))})
        with pytest.raises(InvalidRequestError, match=r"table 'emb'.*\(2, 4\)"):
            client.push({"emb": RowSparse([1, 2], np.ones((2, 4), np.float32))})
        with pytest.raises(InvalidRequestError, match=r"table 'emb'.*3 ids.*\(2, 3\)"):
            client.push({"emb": RowSparse([1, 2, 3], np.ones((2, 3), np.float32))})
        with pytest.raises(UnknownVariableError, match="table 'nope'"):
            client.pull_rows("nope", [1])

        # The same requests straight to the shard (no client-side checks): the shard refuses
        # them itself, with INVALID_ARGUMENT naming the table and the offending id.
        stub = client.links[0].stub
        bad_pushes = {
            "id 10": {"emb": RowSparse([10], np.ones((1, 3), np.float32))},
            r"\(1, 2\)": {"emb": RowSparse([1], np.ones((1, 2), np.float32))},
            "non-finite.*id 4": {
                "emb": RowSparse([2, 4], np.array([[0, 0, 0], [0, np.nan, 0]], np.float32))
            },
            "dense tensor": {"emb": np.ones((10, 3), np.float32)},
            "not a table": {"w": RowSparse([0], np.ones((1, 2), np.float32))},
        }
        for step, (pattern, grads) in enumerate(bad_pushes.items()):
            with pytest.raises(grpc.RpcError) as info:
                stub.Push(push_stream(0, 100 + step, grads, 1 << 20), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, pattern
            assert re.search(f"('emb'|'w').*{pattern}", info.value.details()), pattern
        query = ps_pb2.RowQuery(table="emb", ids=np.array([2, 99], "<i8").tobytes())
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Pull(ps_pb2.PullRequest(worker_id=0, step=0, rows=[query]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search("table 'emb'.*id 99", info.value.details())
        with pytest.raises(Exception, match="embedding table"):
            client.pull(["emb"])
        assert np.array_equal(client.pull_rows("emb", np.arange(10)), before)
        assert client.status()[0].pushes_applied == 0


def test_dynamic_table_makes_rows_on_first_touch_and_evicts_least_recently_used(shards):
    (server,) = shards(1)
    table = Table(None, 3, init="uniform", init_scale=0.5, seed=9, capacity=4)
    with psworker.connect([server.address], mode="async") as client:
        client.init({}, psworker.SGD(lr=1.0), tables={"hashed": table})
        big = [2**62 + 1, -(2**61), 7, 123456789]
        rows = client.pull_rows("hashed", big)
        assert np.array_equal(rows, init_rows(np.array(big), 3, "float32", "uniform", 0.5, 9))
        client.push({"hashed": RowSparse([7, 7], np.ones((2, 3), np.float32))})  # summed
        assert np.allclose(client.pull_rows("hashed", [7]), rows[2] - 2.0)
        client.pull_rows("hashed", [1, 2])  # two new rows: the two least recently used go
        (status,) = client.status()
        (t,) = status.tables
        assert (t.name, t.rows, t.evictions, t.capacity) == ("hashed", 4, 2, 4)
        # 2**62 + 1 and -(2**61) were evicted: touched again, they start over from the seed;
        # 7 kept its update.
        again = client.pull_rows("hashed", [2**62 + 1, 7])
        assert np.array_equal(again[0], rows[0]) and np.allclose(again[1], rows[2] - 2.0)
        with pytest.raises(psworker.TooLargeError, match="capacity of 4"):
            client.pull_rows("hashed", np.arange(5))


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_tables_train_in_async_and_ssp(shards, mode):
    addrs = [s.address for s in shards(2)]
    losses: dict[int, list[float]] = {}

    def worker(i: int):
        def run():
            with psworker.connect(
                addrs, worker_id=i, num_workers=2, mode=mode, staleness=1
            ) as client:
                emb = Embedding(None, 2, client, name="emb", init="zeros")
                opt = DistributedOptimizer(torch.nn.Sequential(emb), client, psworker.SGD(lr=0.5))
                g = torch.Generator().manual_seed(i)
                losses[i] = []
                for _ in range(25):
                    ids = torch.randint(-5, 5, (8,), generator=g) * 1_000_003
                    opt.zero_grad()
                    # Target: every row should become (1, -1).
                    loss = ((opt.model(ids) - torch.tensor([1.0, -1.0])) ** 2).mean()
                    loss.backward()
                    opt.step()
                    losses[i].append(float(loss.detach()))

        return run

    run_workers([worker(0), worker(1)])
    for i in (0, 1):
        assert losses[i][-1] < 0.1 * losses[i][0]


def _table_run(address: str, steps: int, after_step=lambda step: None) -> tuple[np.ndarray, int]:
    """One async worker pushing fixed row gradients; ``after_step(step)`` runs after each push.
    Returns the table's rows and how many shard restarts the worker recovered from."""
    table = Table(None, 3, init="uniform", seed=4, capacity=100)
    with psworker.connect([address], mode="async", timeout=20, retry_s=20) as client:
        client.init({"w": np.zeros(2, np.float32)}, psworker.Adagrad(lr=0.1), tables={"t": table})
        g = np.random.default_rng(5)
        for step in range(steps):
            ids = g.integers(-30, 30, size=6) * 7919
            grads = {"t": RowSparse(ids, g.standard_normal((6, 3)).astype(np.float32))}
            client.push({**grads, "w": np.ones(2, np.float32)})
            after_step(step)
        return client.pull_rows("t", np.arange(-30, 30) * 7919), client.links[0].recoveries


def test_a_shard_restarted_between_calls_resumes_tables_and_the_worker_replays(tmp_path):
    """The shard is replaced between two pushes (no call fails: the new one is up before the
    next push): it restores its last checkpoint, refuses the push made for the old incarnation
    with ABORTED, and the worker replays the steps since that checkpoint."""
    from psserver.checkpoint import Checkpointer, CheckpointScheduler
    from psserver.server import start_server
    from psserver.shard import Shard

    servers: list = []

    def serve(port: int = 0) -> None:
        shard = Shard()
        saver = CheckpointScheduler(shard, Checkpointer(tmp_path))
        saver.resume()  # the newest checkpoint, if any
        servers.append((start_server(shard, port=port, checkpoint=saver.checkpoint), saver))

    def after_step(step: int) -> None:
        server, saver = servers[-1]
        if step == 7:
            saver.checkpoint()  # covers steps 0-7
        if step == 10:  # as kill -9 and a restart: steps 8-10 are gone with the process
            server.stop(grace=0)
            serve(int(server.address.rsplit(":", 1)[1]))

    serve()
    try:
        faulty, recoveries = _table_run(servers[0][0].address, 14, after_step)
    finally:
        for server, _ in servers:
            server.stop(grace=0)
    assert recoveries == 1 and len(servers) == 2
    clean_server = start_server(Shard())  # the same pushes, no fault
    try:
        clean, _ = _table_run(clean_server.address, 14)
    finally:
        clean_server.stop(grace=0)
    assert clean.tobytes() == faulty.tobytes()


@pytest.mark.parametrize(
    "order",
    [
        "zero_grad_after_forward",
        "a_discarded_backward_first",
        "the_modules_zero_grad",
        "zero_grad_in_place",
    ],
)
def test_zero_grad_between_forward_and_backward_keeps_the_tables_gradient(order):
    # torch allows zero_grad anywhere before backward; it clears gradients, not forwards. A
    # zero_grad after the forward once dropped the table's rows silently: the dense layers
    # trained and the table never moved. And model.zero_grad() once left a discarded
    # backward's rows to be pushed.
    ids, y = data(4 * BATCH)

    def run(order: str) -> tuple[np.ndarray, np.ndarray]:
        with psworker.connect(mode="local") as client:
            net = Net(Embedding(ROWS, DIM, client, name="emb"), bag=False)
            opt = DistributedOptimizer(net, client, psworker.Adagrad(lr=0.3))
            for t in range(3):
                batch = slice(BATCH * t, BATCH * (t + 1))
                loss = lambda b=batch: torch.nn.functional.mse_loss(net(ids[b]), y[b])  # noqa: E731
                if order == "zero_grad_first":
                    opt.zero_grad()
                    loss().backward()
                elif order == "zero_grad_after_forward":
                    pending = loss()
                    opt.zero_grad()
                    pending.backward()
                else:  # a whole backward whose gradient zero_grad discards, then the real one
                    loss(slice(3 * BATCH, 4 * BATCH)).backward()
                    # The module's own zero_grad (a GAN's netD.zero_grad()) never sees the
                    # rows; it must discard their gradient all the same.
                    if order == "zero_grad_in_place":
                        opt.zero_grad(set_to_none=False)
                    else:
                        (net if order == "the_modules_zero_grad" else opt).zero_grad()
                    loss().backward()
                opt.step()
            return client.pull_rows("emb", np.arange(ROWS)), net.head.weight.detach().numpy()

    rows, head = run("zero_grad_first")
    assert not np.array_equal(rows, dense_embedding(False).weight.detach().numpy())  # trained
    got_rows, got_head = run(order)
    assert np.array_equal(got_rows, rows) and np.array_equal(got_head, head)


def test_unscale_and_clip_before_step_keep_the_tables_gradient():
    # The AMP loop that clips: scaler.unscale_(opt), clip_grad_norm_, scaler.step(opt). Both
    # write the table handle's empty gradient in place; the rows' gradient must still count,
    # unscaled once (equal to the same loop without the scaler, whose scale is a power of 2).
    ids, y = data(3 * BATCH)

    def run(scaled: bool) -> np.ndarray:
        with psworker.connect(mode="local") as client:
            net = Net(Embedding(ROWS, DIM, client, name="emb"), bag=False)
            opt = DistributedOptimizer(net, client, psworker.SGD(lr=0.5))
            scaler = torch.amp.GradScaler("cpu", enabled=scaled)
            for t in range(3):
                b = slice(BATCH * t, BATCH * (t + 1))
                opt.zero_grad()
                scaler.scale(torch.nn.functional.mse_loss(net(ids[b]), y[b])).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)  # a no-op clip
                scaler.step(opt)
                scaler.update()
            return client.pull_rows("emb", np.arange(ROWS))

    rows = run(scaled=True)
    assert not np.array_equal(rows, dense_embedding(False).weight.detach().numpy())  # trained
    assert np.array_equal(rows, run(scaled=False))


def test_forwards_no_backward_can_reach_hold_no_rows():
    """An evaluation loop without ``torch.no_grad()`` (a loss computed, never backpropagated)
    between training steps: each forward's rows go with its graph (was: held until the next
    step, the batch's rows per forward: RSS grew by 1 MB a forward of 4,096 ids of dim 64),
    and the training steps around it train as torch's."""
    ids, y = data(8 * BATCH)
    torch_net = Net(dense_embedding(False), bag=False)
    reference = torch.optim.SGD(torch_net.parameters(), lr=0.5)
    with psworker.connect(mode="local") as client:
        embedding = Embedding(ROWS, DIM, client, name="emb")
        net = Net(embedding, bag=False)
        opt = DistributedOptimizer(net, client, psworker.SGD(lr=0.5))
        for t in range(4):
            batch = slice(2 * t * BATCH, (2 * t + 1) * BATCH)
            for model, optimizer in ((net, opt), (torch_net, reference)):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(ids[batch]), y[batch]).backward()
                optimizer.step()
            held = slice((2 * t + 1) * BATCH, (2 * t + 2) * BATCH)
            for _ in range(20):  # evaluation, grad enabled: graphs made and dropped
                loss = torch.nn.functional.mse_loss(net(ids[held]), y[held])
            del loss
            assert len(embedding._pending) <= 2  # the last graphs (the loop drops each late)
        trained = client.pull_rows("emb", np.arange(ROWS))
    assert np.allclose(trained, torch_net.embedding.weight.detach().numpy(), atol=1e-6)
    assert np.allclose(net.head.weight.detach(), torch_net.head.weight.detach(), atol=1e-6)


def test_a_copy_or_pickle_of_a_model_holding_a_table_is_refused_by_name():
    """``copy.deepcopy(model)`` (a target network, ``AveragedModel``) or ``torch.save(model)``
    cannot hold rows that live on the shards: a ValueError naming the table (was: "cannot
    pickle '_thread.lock' object" from deep inside the client), and the model trains on."""
    import copy
    import io

    with psworker.connect(mode="local") as client:
        net = Net(Embedding(ROWS, DIM, client, name="emb"), bag=False)
        opt = DistributedOptimizer(net, client, psworker.SGD(lr=0.5))
        for attempt in (lambda: copy.deepcopy(net), lambda: torch.save(net, io.BytesIO())):
            with pytest.raises(ValueError, match="table 'emb' lives on the shards: a copy or"):
                attempt()
        ids, y = data(BATCH)
        before = client.pull_rows("emb", np.arange(ROWS)).copy()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(ids), y).backward()
        opt.step()
        assert not np.array_equal(client.pull_rows("emb", np.arange(ROWS)), before)
