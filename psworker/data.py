"""Data sharding: each worker iterates its own disjoint, deterministic slice, per epoch."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Protocol

import numpy as np

from pswire.errors import ConfigError


class _HasWorkers(Protocol):
    worker_id: int
    num_workers: int


def shard_indices(
    length: int, worker_id: int, num_workers: int, epoch: int, seed: int = 0, shuffle: bool = True
) -> np.ndarray:
    """This worker's sample indices for one epoch, like ``torch.utils.data.DistributedSampler``.

    Every worker gets ``ceil(length / num_workers)`` indices: the permutation (seeded by
    ``(seed, epoch)``, the same on every worker) is padded by wrapping around so it divides
    evenly, then dealt out round-robin. Workers therefore take equal numbers of steps, which
    ``sync`` mode needs; at most ``num_workers - 1`` samples are seen twice per epoch.

    Raises:
        ConfigError: ids out of range.
    """
    if not 0 <= worker_id < num_workers:
        raise ConfigError(f"worker_id {worker_id} must be in [0, {num_workers})")
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(length)
    else:
        order = np.arange(length)
    per_worker = -(-length // num_workers) if length else 0
    total = per_worker * num_workers
    if total > length:
        order = np.concatenate([order, np.resize(order, total - length)])
    return order[worker_id:total:num_workers]


class Sharded:
    """Iterable over one worker's slice; every new iteration is the next epoch.

    Built by ``shard``. ``set_epoch(e)`` pins the epoch of the next iteration, as with
    ``DistributedSampler``.
    """

    def __init__(self, source: Any, worker_id: int, num_workers: int, seed: int, shuffle: bool):
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._loader = None
        if _is_loader(source):
            self._loader = source
            self.dataset = source.dataset
        else:
            self.dataset = source
        if not isinstance(self.dataset, Sized):
            raise TypeError("shard() needs a dataset with __len__ (a map-style dataset)")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        return shard_indices(
            len(self.dataset), self.worker_id, self.num_workers, self.epoch, self.seed, self.shuffle
        )

    def __len__(self) -> int:
        n = len(self.indices())
        if self._loader is None:
            return n
        batch = self._loader.batch_size or 1
        return n // batch if self._loader.drop_last else -(-n // batch)

    def __iter__(self) -> Iterator[Any]:
        idx = self.indices()
        self.epoch += 1
        if self._loader is None:
            return (self.dataset[int(i)] for i in idx)
        return iter(_rebatch(self._loader, idx.tolist()))


def _is_loader(obj: Any) -> bool:
    try:
        from torch.utils.data import DataLoader
    except ImportError:
        return False
    return isinstance(obj, DataLoader)


def _rebatch(loader: Any, indices: list[int]) -> Any:
    """The same DataLoader settings over a fixed list of indices."""
    from torch.utils.data import DataLoader

    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=indices,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
    )


def shard(
    dataset_or_loader: Any, client: _HasWorkers, *, seed: int = 0, shuffle: bool = True
) -> Sharded:
    """This worker's slice of a dataset or DataLoader (batches from a loader, items otherwise).

    Slices of different workers are disjoint (up to the padding that equalises their lengths),
    deterministic for a seed, and reshuffled each epoch with the seed shared by all workers.

    Raises:
        TypeError: an iterable-style dataset (no ``__len__``).
    """
    return Sharded(dataset_or_loader, client.worker_id, client.num_workers, seed, shuffle)
