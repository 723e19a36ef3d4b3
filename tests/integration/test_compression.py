"""Wire compression of pushed gradients: 16 bits on the wire, float32 on the shard."""

from __future__ import annotations

import numpy as np
import pytest

import psworker
from pswire.codec import bfloat16_to_float32, float32_to_bfloat16

ROUNDERS = {
    "fp16": lambda g: g.astype(np.float16).astype(np.float32),
    "bf16": lambda g: bfloat16_to_float32(float32_to_bfloat16(g)),
}


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_pushed_gradients_travel_in_16_bits_and_apply_in_float32(shards, compression):
    rng = np.random.default_rng(3)
    start = {"w": rng.standard_normal((300, 7)).astype(np.float32)}
    grad = {"w": rng.standard_normal((300, 7)).astype(np.float32) / 3}
    servers = shards(2)
    with psworker.connect(
        [s.address for s in servers],
        worker_id=0,
        num_workers=1,
        mode="async",
        compression=compression,
        split_bytes=1024,  # "w" is cut across both shards: each half is compressed
    ) as client:
        client.init(start, psworker.SGD(lr=1.0))
        client.push(grad)
        after = client.pull()["w"]
    assert after.dtype == np.float32
    rounded = ROUNDERS[compression](grad["w"])
    # Exactly the 16-bit-rounded gradient was applied: the wire carried 16 bits...
    np.testing.assert_array_equal(after, start["w"] - rounded)
    # ...which is not the full-precision one.
    assert not np.array_equal(after, start["w"] - grad["w"])


def test_fp16_overflow_is_refused_as_non_finite(shards):
    (server,) = shards(1)
    with psworker.connect(
        [server.address], worker_id=0, num_workers=1, mode="async", compression="fp16"
    ) as client:
        client.init({"w": np.zeros(4, np.float32)}, psworker.SGD(lr=1.0))
        with pytest.raises(psworker.InvalidRequestError, match=r"'w'.*non-finite"):
            client.push({"w": np.array([1e6, 0, 0, 0], np.float32)})
    np.testing.assert_array_equal(server.shard.snapshot()["w"], np.zeros(4, np.float32))


def test_unknown_compression_is_rejected():
    with pytest.raises(ValueError, match="compression"):
        psworker.connect(["127.0.0.1:1"], worker_id=0, num_workers=1, compression="int8")
