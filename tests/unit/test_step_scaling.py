"""A step's work grows linearly with the number of variables: the whole path of a fused step
(placement, the worker's checks and request, the shard's parsing, applying and reply, the
worker's decoding and merging) makes about twice the Python calls for twice the variables.

Counted, not timed: a profile hook counts every function call (Python and C) of one step.
A step that grew quadratically (15,000 variables took 125 s) makes four times the calls.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pytest

from pscore.job import Job, VarSpec
from pscore.optim import SGD
from psserver.shard import Shard
from pswire import read, write
from pswire.codec import ChunkAssembler, header_options, push_pull_grads
from pswire.proto import ps_pb2
from pswire.write import push_header
from psworker.outgoing import split_push
from psworker.placement import VarInfo, plan

FLOATS = 64  # 256 bytes a variable: a few hundred variables make a large (hand-built) message
SHARDS = 2


def calls(fn: Callable[[], object]) -> int:
    """The function calls ``fn`` makes (a profile hook's 'call' and 'c_call' events)."""
    count = 0

    def hook(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


class Job2Shards:
    """A model of ``n`` variables on two shards, with a fused step end to end, no network."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.model = {f"layer{i}.w": np.zeros(FLOATS, np.float32) for i in range(n)}
        self.grads = {k: np.full(FLOATS, 1e-3, np.float32) for k in self.model}
        self.shard_map = plan([VarInfo(k, (FLOATS,), "float32") for k in self.model], SHARDS)
        self.shards = []
        for values in self.shard_map.split(self.model):
            specs = tuple(VarSpec(k, (FLOATS,), "float32", False) for k in values)
            job = Job("async", 0, 1, SGD(lr=0.1), specs, "digest", 0)
            s = Shard()
            s.init(0, job, {k: v.copy() for k, v in values.items()}, take=True)
            self.shards.append(s)
        self.clock = 0

    def step(self) -> dict[str, np.ndarray]:
        pieces = split_push(self.grads, self.shard_map, {}, set(), None)
        merged: dict[str, np.ndarray] = {}
        for shard, part in zip(self.shards, pieces, strict=True):
            header = push_header(0, self.clock, None, None, "")
            sent = write.request(header, part, [], 1000)
            assert isinstance(sent, bytes), "the step must take the hand-built path"
            request = read.parse_request(sent)
            pushed, tensors, clock = shard.push_pull(
                0,
                request.header.step,
                push_pull_grads(request, 1 << 40),
                encode=lambda arrays, _: write.reply_tensors(arrays, frozenset()),
                take=True,
                options=header_options(request.header),
            )
            assert pushed.applied
            reply = read.parse_reply(write.reply(ps_pb2.PushResponse(), tensors, clock))
            assembler = ChunkAssembler()
            for chunk in reply.chunks:
                assembler.add(chunk)
            merged.update(assembler.finish())
        self.clock += 1
        names = list(self.model)
        return self.shard_map.join(merged, names, self.shard_map.destinations(names))


@pytest.mark.parametrize("n", [600])
def test_a_step_makes_twice_the_calls_for_twice_the_variables(n: int) -> None:
    small, large = Job2Shards(n), Job2Shards(2 * n)
    for job in (small, large):  # the first step fills lookup caches; count the steady state
        weights = job.step()
        assert len(weights) == job.n
        assert np.allclose(weights["layer0.w"], -1e-4)  # SGD, lr 0.1, one step of 1e-3
    ratio = calls(large.step) / calls(small.step)
    assert 1.5 < ratio < 2.5, f"twice the variables made {ratio:.2f}x the calls"


def test_placement_makes_twice_the_calls_for_twice_the_variables() -> None:
    def placed(n: int) -> Callable[[], object]:
        infos = [VarInfo(f"v{i}", (FLOATS,), "float32") for i in range(n)]
        return lambda: plan(infos, SHARDS).destinations([v.name for v in infos])

    ratio = calls(placed(4000)) / calls(placed(2000))
    assert 1.5 < ratio < 2.5, f"placing twice the variables made {ratio:.2f}x the calls"
