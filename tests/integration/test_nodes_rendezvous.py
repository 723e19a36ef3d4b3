"""The nodes of a multi-node ``psctl local`` job meeting in a real TCPStore on 127.0.0.1, in
one process: the job's layout each node gets, and the refusals (another job's settings, a node
rank taken twice, a node that never comes)."""

from __future__ import annotations

import threading

import pytest
from ports import free_port

from psctl.nodes import Layout, NodeError, Nodes, NodesConfig


def never() -> None:
    """An interrupt check that never interrupts."""


def nodes_of(nnodes: str, ranks: list[int], join_timeout: float = 30.0) -> list[Nodes]:
    rdzv = f"127.0.0.1:{free_port()}"
    return [
        Nodes(NodesConfig(nnodes, r, rdzv, join_timeout_s=join_timeout), 30.0, never)
        for r in ranks  # rank 0 first: it hosts the store
    ]


JOB = {"mode": "sync", "staleness": 1, "workers": 2}


def join_all(nodes: list[Nodes], shards: list[list[str]], workers: list[int]) -> list[Layout]:
    layouts: dict[int, Layout | Exception] = {}

    def one(i: int) -> None:
        try:
            nodes[i].agree(JOB)
            layouts[i] = nodes[i].join(shards[i], workers[i])
        except Exception as exc:
            layouts[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out = [layouts[i] for i in range(len(nodes))]
    assert not any(isinstance(x, Exception) for x in out), out
    return out  # type: ignore[return-value]


@pytest.mark.timeout(60)
def test_fixed_nodes_concatenate_shards_and_number_workers_in_node_order() -> None:
    nodes = nodes_of("3", [0, 1, 2])
    layouts = join_all(nodes, [["a:1"], ["b:1", "b:2"], []], [2, 1, 3])
    assert all(x.shards == ["a:1", "b:1", "b:2"] for x in layouts)
    assert [x.first_worker for x in layouts] == [0, 2, 3]
    assert {x.num_workers for x in layouts} == {6} and {x.elastic for x in layouts} == {None}
    assert len({x.job_id for x in layouts}) == 1


@pytest.mark.timeout(60)
def test_elastic_nodes_use_node_0s_shards_and_fixed_id_ranges() -> None:
    nodes = nodes_of("1:4", [0, 2])
    layouts = join_all(nodes, [["a:1"], []], [2, 2])
    assert all(x.shards == ["a:1"] for x in layouts)
    assert [x.first_worker for x in layouts] == [0, 4]
    assert {x.elastic for x in layouts} == {"2:8"} and {x.num_workers for x in layouts} == {8}


@pytest.mark.timeout(60)
def test_a_node_of_another_job_or_a_taken_rank_is_refused() -> None:
    node0, node1, again = nodes_of("2", [0, 1, 1])
    node0.agree(JOB)
    with pytest.raises(NodeError, match="node 1 has mode 'async' but node 0 has 'sync'"):
        node1.agree({**JOB, "mode": "async"})
    with pytest.raises(NodeError, match="node rank 1 is already taken"):
        again.agree(JOB)


@pytest.mark.timeout(60)
def test_a_node_that_never_comes_is_named() -> None:
    (node0,) = nodes_of("2", [0], join_timeout=1.0)
    node0.agree(JOB)
    with pytest.raises(NodeError, match=r"all 2 nodes did not arrive .*still missing: nodes \[1\]"):
        node0.join(["a:1"], 1)


@pytest.mark.timeout(60)
def test_an_elastic_rank_is_taken_back_only_once_its_holder_is_silent() -> None:
    rdzv = f"127.0.0.1:{free_port()}"

    def launcher(rank: int) -> Nodes:
        config = NodesConfig("1:3", rank, rdzv, join_timeout_s=30.0, node_timeout_s=2.5)
        return Nodes(config, 30.0, never)

    node0, first = launcher(0), launcher(1)
    node0.agree(JOB)
    first.agree(JOB)
    first.start_beating()
    with pytest.raises(NodeError, match=r"node rank 1 is already taken .* still beats"):
        launcher(1).agree(JOB)
    first.close()  # its launcher is gone: no more beats
    launcher(1).agree(JOB)  # after 2.5 s of silence the rank is free again
    with pytest.raises(NodeError, match="node rank 0 is already taken"):
        launcher(0).agree(JOB)  # node 0 hosts the store: never taken back


@pytest.mark.timeout(60)
def test_node_0_keeps_its_store_until_the_others_are_through_with_it() -> None:
    rdzv = f"127.0.0.1:{free_port()}"
    configs = [NodesConfig("2", r, rdzv, join_timeout_s=30.0, node_timeout_s=30.0) for r in (0, 1)]
    node0, node1 = (Nodes(c, 30.0, never) for c in configs)
    join_all([node0, node1], [["a:1"], ["b:1"]], [1, 1])
    node1.settle(0, False, never, print)  # node 1's workers are done
    node0.settle(0, True, never, print)  # node 0's too: nobody else running
    released = threading.Thread(target=node0.release, args=(True, lambda: None, print))
    released.start()
    # Node 0 has released, but node 1 has not read that yet: node 0 must not end (and take
    # its store with it) before node 1 says it is through.
    released.join(1.0)
    assert released.is_alive()
    node1.release(True, never, print)  # reads "released" from the store that is still up
    node1.close()
    released.join(20)
    assert not released.is_alive()
    node0.close()


@pytest.mark.timeout(60)
def test_node_0s_exit_barrier_ends_at_the_node_timeout_when_a_node_never_closes() -> None:
    rdzv = f"127.0.0.1:{free_port()}"
    configs = [NodesConfig("2", r, rdzv, join_timeout_s=30.0, node_timeout_s=2.0) for r in (0, 1)]
    node0, node1 = (Nodes(c, 30.0, never) for c in configs)
    join_all([node0, node1], [["a:1"], []], [1, 1])
    node0.release(True, lambda: None, print)  # node 1 never closes (killed): returns anyway
    node0.close()
