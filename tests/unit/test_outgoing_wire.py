"""What a gradient costs on the wire, counted without compressing it (DiLoCo's byte counts),
is what compressing it gives."""

from __future__ import annotations

import numpy as np
import pytest

from psworker.outgoing import compress, wire_nbytes


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64])
def test_wire_nbytes_is_the_compressed_size(compression: str | None, dtype: type) -> None:
    grad = np.arange(37, dtype=dtype).reshape(37)
    assert wire_nbytes(grad, compression) == compress(grad, compression).nbytes
