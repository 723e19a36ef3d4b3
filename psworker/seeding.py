"""Per-worker seeds: each worker of a job draws its own random numbers (noise, dropout masks,
augmentations) from one base seed, reproducibly."""

from __future__ import annotations

import random
import sys
from typing import Protocol

import numpy as np


class _HasWorkerId(Protocol):
    worker_id: int


# Seeds stay below 2**32 (numpy's global seed and DataLoader workers' limit).
_SEED_SPACE = 2**32


def worker_seed(base: int, worker_id: int) -> int:
    """Worker ``worker_id``'s seed for a job seeded with ``base``: ``base + worker_id`` (as
    torch's DataLoader seeds its workers), modulo 2**32.

    Raises:
        ValueError: a negative base or worker id.
    """
    if base < 0 or worker_id < 0:
        raise ValueError(f"seed base {base} and worker_id {worker_id} must be >= 0")
    return (base + worker_id) % _SEED_SPACE


def seed(base: int, client: _HasWorkerId) -> int:
    """Seeds this worker's ``random``, ``numpy.random`` and (when imported) torch generators
    with ``worker_seed(base, client.worker_id)``, and returns that seed.

    Call it where a single-process script calls ``torch.manual_seed(base)``: with one seed
    every worker would draw the same noise and dropout masks, so a sync step would average
    identical samples. The data order of ``shard()`` is not affected (its ``seed`` is the
    job's, shared by every worker, so slices stay disjoint); DataLoader workers seed from
    torch's generator, so they differ per worker too.

    Raises:
        ValueError: as ``worker_seed``.
    """
    value = worker_seed(base, client.worker_id)
    random.seed(value)
    np.random.seed(value)
    torch = sys.modules.get("torch")  # a numpy-only worker need not import torch
    if torch is not None:
        torch.manual_seed(value)
    return value
