"""Comparing trained models' states in tests."""

from __future__ import annotations

import torch


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same tensors under the same names, bit for bit (naming the first that differs)."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max diff {(a[name] - b[name]).abs().max()}"
