"""What all-reduce ranks must agree on at every step, checked beside the gradients.

Each rank applies the averaged gradient with its own optimizer, so ranks whose optimizer
settings differ (lr 0.1 on one, 0.5 on another) or whose step hyper-parameters differ (a
scheduler stepped differently) would train apart in silence. Every step each rank writes a
digest of what it is about to apply into its own row of a (ranks x DIGEST_BYTES) tensor that
rides in the gradients' first bucket; other rows are zero, so the sum is every rank's digest,
exact in any wire dtype (each entry is one byte, 0..255, plus zeros). On a mismatch, which
every rank sees at once, the ranks exchange their settings in full (two more collectives) so
the error names the ranks and the values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from pscore.optim import Optimizer
from pswire.errors import HyperParameterMismatchError, PSError

# The tensor's name among the gradients: sorts before every model name, so it travels in the
# first bucket of its dtype.
AGREE_KEY = "\x00agree"
DIGEST_BYTES = 16


class Summing(Protocol):
    """What the exchange needs of a ring: an elementwise sum over every rank."""

    def allreduce(self, array: np.ndarray) -> np.ndarray: ...


def groups_digest(group: Mapping[str, int]) -> str:
    """Which variable trains in which parameter group, as a short digest (fixed at init)."""
    text = json.dumps(sorted(group.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def settings(optimizers: Sequence[Optimizer], groups: str) -> dict[str, str]:
    """What one step applies with, as ``what -> value`` lines: each parameter group's optimizer
    class and hyper-parameters (the step's, after a scheduler's changes), and ``groups``."""
    out = {"parameter groups (which variable is in which)": groups}
    for index, optimizer in enumerate(optimizers):
        out[f"group {index} optimizer"] = optimizer.name
        out.update({f"group {index} {k}": repr(v) for k, v in optimizer.params().items()})
    return out


def digest_row(described: Mapping[str, str]) -> np.ndarray:
    """``described``'s digest as DIGEST_BYTES values 0..255 (float32)."""
    text = json.dumps(sorted(described.items()))
    raw = hashlib.sha256(text.encode()).digest()[:DIGEST_BYTES]
    return np.frombuffer(raw, dtype=np.uint8).astype(np.float32)


def agreement_tensor(rank: int, world_size: int, described: Mapping[str, str]) -> np.ndarray:
    """This rank's contribution: its digest in row ``rank``, zeros elsewhere."""
    table = np.zeros((world_size, DIGEST_BYTES), dtype=np.float32)
    table[rank] = digest_row(described)
    return table


def disagree(summed: np.ndarray) -> bool:
    """Whether the summed tensor holds more than one distinct digest."""
    rows = np.asarray(summed, dtype=np.float64)
    return bool((rows != rows[0]).any())


def gather_texts(ring: Summing, rank: int, world_size: int, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (two sums: the lengths, then the bytes).

    Raises:
        PSError: as the ring's collectives (a peer is gone or silent).
    """
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = np.zeros(world_size, dtype=np.float64)
    lengths[rank] = len(data)
    lengths = ring.allreduce(lengths)
    table = np.zeros((world_size, max(1, int(lengths.max()))), dtype=np.float64)
    table[rank, : len(data)] = data
    table = ring.allreduce(table)
    return [
        bytes(table[r, : int(lengths[r])].astype(np.uint8)).decode("utf-8", "replace")
        for r in range(world_size)
    ]


def check(
    ring: Summing,
    rank: int,
    world_size: int,
    summed: np.ndarray,
    described: Mapping[str, str],
    step: int,
) -> None:
    """Raises, on every rank alike, when the summed digests differ.

    Raises:
        HyperParameterMismatchError: naming each differing setting and every rank's value
            (or only the ranks, when the full exchange itself failed).
    """
    if not disagree(summed):
        return
    rows = np.asarray(summed, dtype=np.float64)
    firsts: dict[bytes, int] = {}
    kinds = [firsts.setdefault(rows[r].tobytes(), r) for r in range(world_size)]
    odd = [r for r in range(world_size) if kinds[r] != 0]
    head = (
        f"all-reduce ranks disagree on the optimizer at step {step}: ranks {odd} apply other "
        "settings than rank 0"
    )
    tail = (
        "; every rank must build the same optimizer (class, hyper-parameters, parameter "
        "groups) and change it alike each step (the same scheduler, stepped the same number "
        "of times)"
    )
    try:
        texts = gather_texts(ring, rank, world_size, json.dumps(dict(described)))
        each = [json.loads(t) for t in texts]
    except (PSError, ValueError) as exc:
        raise HyperParameterMismatchError(
            f"{head} (their values could not be exchanged: {exc}){tail}"
        ) from exc
    keys = sorted({k for d in each for k in d})
    lines = []
    for key in keys:
        values = [d.get(key, "(none)") for d in each]
        if len(set(values)) > 1:
            lines.append(f"{key}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    raise HyperParameterMismatchError(f"{head}: " + "; ".join(lines) + tail)
