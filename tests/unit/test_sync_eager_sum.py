"""A sync round sums its pushes as they arrive, in worker order, holding only those that come
before their turn: the same bits as summing every push in worker order at the close, whatever
the order of arrival, with quorum, a dropped worker that comes back, or an elastic member that
leaves. The rule called directly, as the shard calls it (lock held)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from pscore.tables import RowSparse
from psserver.consistency import Clocks, SyncPolicy

WORKERS = 4


def pushes(seed: int = 0) -> dict[int, dict[str, Any]]:
    """Each worker's gradients: magnitudes far apart, so the order of addition shows in the
    bits; a float and an integer buffer; table rows, some ids shared."""
    rng = np.random.default_rng(seed)
    out = {}
    for w in range(WORKERS):
        scale = np.float32(10.0 ** (3 * w - 4))
        out[w] = {
            "w": (rng.standard_normal(64) * scale).astype(np.float32),
            "mean": rng.standard_normal(3).astype(np.float32),
            "steps": np.array(w * 7 - 9, np.int64),
            "emb": RowSparse(
                np.array([w, 5, 9 - w]), rng.standard_normal((3, 2)).astype(np.float32)
            ),
        }
    return out


def fresh(grads: dict[str, Any]) -> dict[str, Any]:
    """A push's own copy (as decoded for one call)."""
    return {
        k: RowSparse(v.ids.copy(), v.values.copy()) if isinstance(v, RowSparse) else v.copy()
        for k, v in grads.items()
    }


def at_close(grads: dict[int, dict[str, Any]], order: list[int]) -> dict[str, Any]:
    """The sum as the rule made it before: every push held, added in worker order at the
    close, divided by the count."""
    policy = SyncPolicy()
    live = set(order)
    out = None
    for w in sorted(order):
        out = policy.submit(Clocks(0, {}, live), w, 0, fresh(grads[w]))
    assert out is not None
    return dict(out)


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def raw(v: Any) -> bytes:
        return v.ids.tobytes() + v.values.tobytes() if isinstance(v, RowSparse) else v.tobytes()

    return a.keys() == b.keys() and all(raw(a[k]) == raw(b[k]) for k in a)


def reference(grads: dict[int, dict[str, Any]], order: list[int]) -> dict[str, Any]:
    """Worker order at the close, written out: the first push's copy, then += in order."""
    ws = sorted(order)
    out: dict[str, Any] = {}
    for key in ("w", "mean", "steps"):
        acc = grads[ws[0]][key].copy()
        for w in ws[1:]:
            acc += grads[w][key]
        out[key] = acc / acc.dtype.type(len(ws)) if acc.dtype.kind == "f" else acc // len(ws)
    ids = np.concatenate([grads[w]["emb"].ids for w in ws])
    values = np.concatenate([grads[w]["emb"].values for w in ws])
    order_ids = np.argsort(ids, kind="stable")
    unique, starts = np.unique(ids[order_ids], return_index=True)
    summed = np.add.reduceat(values[order_ids], starts, axis=0)
    out["emb"] = RowSparse(unique, summed / np.float32(len(ws)))
    return out


def test_the_order_of_addition_shows_in_these_bits() -> None:
    grads = pushes()
    forward = grads[0]["w"] + grads[1]["w"] + grads[2]["w"] + grads[3]["w"]
    backward = grads[3]["w"] + grads[2]["w"] + grads[1]["w"] + grads[0]["w"]
    assert forward.tobytes() != backward.tobytes()  # so the test below can fail


def read_only(grads: dict[str, Any]) -> dict[str, Any]:
    """A push decoded for one call into read-only arrays (Flight's one-batch tensors)."""
    out = fresh(grads)
    for v in out.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return out


@pytest.mark.parametrize("owned", [False, True, "read-only"])
def test_every_order_of_arrival_gives_the_bits_of_the_sum_at_the_close(owned: Any) -> None:
    grads = pushes()
    expected = reference(grads, list(range(WORKERS)))
    assert same_bits(at_close(grads, list(range(WORKERS))), expected)
    live = set(range(WORKERS))
    decode = read_only if owned == "read-only" else fresh
    for order in itertools.permutations(range(WORKERS)):
        policy = SyncPolicy()
        update = None
        sent = {w: decode(grads[w]) for w in order}
        for w in order:
            assert update is None
            update = policy.submit(Clocks(0, {}, live), w, 0, sent[w], owned=bool(owned))
        assert update is not None and same_bits(dict(update), expected), order
        assert policy.pending_bytes() == 0
        # A push's arrays are written only where they are ours to change (owned and
        # writeable); a read-only one would have raised.
        if owned is not True:
            assert all(same_bits(sent[w], grads[w]) for w in order)


def test_a_lone_read_only_push_is_the_mean_without_a_copy() -> None:
    grads = pushes()
    sent = read_only(grads[2])
    update = SyncPolicy().submit(Clocks(0, {}, {2}), 2, 0, sent, owned=True)
    assert update is not None and same_bits(dict(update), reference(grads, [2]))
    assert update["w"] is sent["w"] and update["mean"] is sent["mean"]


def test_pushes_in_turn_are_summed_at_once_and_only_early_ones_are_held() -> None:
    grads = pushes()
    one = sum(g.nbytes for g in grads[0].values())
    live = set(range(WORKERS))
    policy = SyncPolicy()
    for w in (0, 1):  # in turn: the round holds the sum and the rows, nothing more
        policy.submit(Clocks(0, {}, live), w, 0, fresh(grads[w]), owned=True)
    rows = sum(grads[w]["emb"].nbytes for w in (0, 1))
    assert policy.pending_bytes() == one - grads[0]["emb"].nbytes + rows
    policy.submit(Clocks(0, {}, live), 3, 0, fresh(grads[3]), owned=True)  # before 2: held
    assert policy.pending_bytes() == one - grads[0]["emb"].nbytes + rows + one


def test_quorum_sums_the_first_pushes_in_worker_order() -> None:
    grads = pushes()
    live = set(range(WORKERS))
    for order in itertools.permutations(range(WORKERS), 2):
        policy = SyncPolicy(quorum=2)
        assert policy.submit(Clocks(0, {}, live), order[0], 0, fresh(grads[order[0]])) is None
        update = policy.submit(Clocks(0, {}, live), order[1], 0, fresh(grads[order[1]]))
        assert update is not None and same_bits(dict(update), reference(grads, list(order)))


def test_a_dropped_worker_that_comes_back_into_the_round_is_added_in_its_turn() -> None:
    # A job of fixed size: worker 0 is dropped (not live) while 1 and 2 push, then comes back
    # and pushes the open step: its push goes first in the sum, as at the close.
    grads = {w: g for w, g in pushes().items() if w < 3}
    policy = SyncPolicy()
    assert policy.submit(Clocks(0, {}, {1, 2}), 2, 0, fresh(grads[2])) is None
    assert policy.submit(Clocks(0, {}, {0, 1, 2}), 1, 0, fresh(grads[1])) is None  # 0 is back
    update = policy.submit(Clocks(0, {}, {0, 1, 2}), 0, 0, fresh(grads[0]))
    assert update is not None and same_bits(dict(update), reference(grads, [0, 1, 2]))
    # It stays away: the round closes when the live ones pushed, 1 then 2 added at the close.
    policy = SyncPolicy()
    assert policy.submit(Clocks(0, {}, {1, 2}), 2, 0, fresh(grads[2])) is None
    update = policy.submit(Clocks(0, {}, {1, 2}), 1, 0, fresh(grads[1]))
    assert update is not None and same_bits(dict(update), reference(grads, [1, 2]))


def test_an_elastic_member_that_leaves_lets_the_pushes_after_it_be_added() -> None:
    grads = pushes()
    joined = {w: 0 for w in range(WORKERS)}
    members = set(range(WORKERS))

    def elastic(live: set[int]) -> Clocks:
        return Clocks(0, {}, live, {w: s for w, s in joined.items() if w in live}, opened=0)

    policy = SyncPolicy()
    for w in (2, 1):  # before their turn: held while worker 0 may still push
        assert policy.submit(elastic(members), w, 0, fresh(grads[w]), owned=True) is None
    held = policy.pending_bytes()
    assert policy.membership_changed(elastic(members - {0})) is None  # 3 still to push
    dense = sum(v.nbytes for k, v in grads[2].items() if k != "emb")
    assert policy.pending_bytes() == held - dense  # 1 and 2 summed into 1's arrays
    update = policy.submit(elastic(members - {0}), 3, 0, fresh(grads[3]), owned=True)
    assert update is not None and same_bits(dict(update), reference(grads, [1, 2, 3]))


@pytest.mark.parametrize("deferred", [(0,), (1, 3), (0, 1, 2, 3)])
def test_deferred_pushes_are_summed_at_the_close_only_when_the_update_is_read(
    deferred: tuple[int, ...],
) -> None:
    """A push a preview reads (``defer``) is left alone until the round closes, and the
    round's update sums on first use, to the same bits in every order of arrival."""
    grads = pushes()
    expected = reference(grads, list(range(WORKERS)))
    live = set(range(WORKERS))
    for order in itertools.permutations(range(WORKERS)):
        policy = SyncPolicy()
        arrived = {w: fresh(grads[w]) for w in order}
        kept = {w: fresh(arrived[w]) for w in deferred}  # what the preview still reads
        for w in deferred:
            policy.defer(w)
        update = None
        for w in order:
            update = policy.submit(Clocks(0, {}, live), w, 0, arrived[w], owned=True)
            for d in deferred:  # untouched until the close
                assert same_bits(arrived[d], kept[d]), (order, w, d)
        assert update is not None
        assert sorted(update) == sorted(expected)  # known before anything is summed
        for d in deferred:
            assert same_bits(arrived[d], kept[d]), (order, d)
        assert same_bits(dict(update), expected), order
        assert policy.pending_bytes() == 0
