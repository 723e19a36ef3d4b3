"""Data sharding: each worker iterates its own disjoint, deterministic slice, per epoch; in an
elastic job the slices follow the members of each epoch (``psworker/epochs.py``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sized
from typing import Any, Protocol

import numpy as np

from pswire.errors import ConfigError
from psworker.api import Client, Elastic
from psworker.epochs import EpochPlan, plan_epoch

log = logging.getLogger(__name__)


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
    ``DistributedSampler``. With an elastic client each iteration is the rest of the epoch in
    progress at the client's step, split among that epoch's members (``psworker/epochs.py``):
    loop with ``for epoch in data.epochs(n): for batch in data: ...`` so that a worker that
    joins late trains the job's remaining epochs, not n of its own. ``samples`` holds how many
    samples this worker drew in each epoch (logged as each one ends).
    """

    def __init__(
        self,
        source: Any,
        worker_id: int,
        num_workers: int,
        seed: int,
        shuffle: bool,
        client: Any = None,
        first_step: int = 0,
    ):
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.samples: dict[int, int] = {}
        self.plan: EpochPlan | None = None  # elastic: the epoch of the last iteration
        self._elastic = client if isinstance(client, Elastic) else None
        self._first_step = first_step
        self._loader = None
        self._own: _UserOrder | None = None  # the loader's own sampler or batch_sampler
        self._order = _Order()  # what the rebuilt loader iterates this epoch
        self._rebuilt: Any = None
        if _is_loader(source):
            self._loader = source
            self.dataset = source.dataset
            self._own = _UserOrder.of(source)
        else:
            self.dataset = source
        if not isinstance(self.dataset, Sized):
            raise TypeError("shard() needs a dataset with __len__ (a map-style dataset)")
        if self._own is not None and self._elastic is not None:
            raise ConfigError(
                f"shard() of a DataLoader with its own {self._own.what} in an elastic job: the "
                "epochs' re-split among members works on the dataset's indices; pass a loader "
                "built with shuffle=True/False and batch_size (or shard the dataset)"
            )

    @property
    def num_samples(self) -> int:
        """How many samples this worker draws in the next epoch: what a script divides by
        where a single-process one uses ``len(loader.dataset)`` (``dataset`` stays the
        whole dataset, every worker's)."""
        if self._own is not None:
            return sum(self._own.sizes(self._own_part()))
        return len(self.indices())

    @property
    def loader(self) -> Any:
        """The DataLoader this worker iterates: the one given, every setting kept
        (``num_workers``, ``collate_fn``, ``worker_init_fn``, ``persistent_workers``,
        ``prefetch_factor``, ``timeout``, ``generator``, ``multiprocessing_context``, pinning),
        over this worker's slice; None for a dataset."""
        if self._loader is None:
            return None
        if self._rebuilt is None:
            batches = self._own is not None and self._own.batches
            self._rebuilt = _rebuild(self._loader, self._order, batches)
        return self._rebuilt

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """This worker's sample indices for the next iteration (elastic: what is left of the
        epoch in progress)."""
        if self._elastic is None:
            return shard_indices(
                len(self.dataset),
                self.worker_id,
                self.num_workers,
                self.epoch,
                self.seed,
                self.shuffle,
            )
        plan = self._plan()
        members = len(plan.members)
        idx = shard_indices(
            len(self.dataset), plan.rank, members, plan.epoch, self.seed, self.shuffle
        )
        return idx[plan.offset * self._batch() :]

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs until ``count``, from the one in progress (elastic: at the client's
        step; a worker that joined late starts mid-way). Iterate the data once in each.

        Raises:
            RuntimeError: an epoch went by without the data being iterated.
        """
        last = None
        while True:
            epoch = self._plan().epoch if self._elastic is not None else self.epoch
            if epoch >= count:
                return
            if epoch == last:
                raise RuntimeError(f"epoch {epoch} came round again: iterate the data in it")
            last = epoch
            yield epoch

    def __len__(self) -> int:
        if self._own is not None and self._own.batches:
            return len(self._own_part())
        n = len(self._own_part()) if self._own is not None else len(self.indices())
        if self._loader is None:
            return n
        batch = self._loader.batch_size or 1
        return n // batch if self._loader.drop_last else -(-n // batch)

    def __iter__(self) -> Iterator[Any]:
        if self._own is not None:
            part = self._own_part()
            epoch = self.epoch
            self.epoch = epoch + 1
            self._order.items = part
            return self._counted(iter(self.loader), epoch, self._own.sizes(part))
        idx = self.indices()
        epoch = self.plan.epoch if self._elastic is not None and self.plan else self.epoch
        self.epoch = epoch + 1
        if self._loader is None:
            items: Iterable[Any] = (self.dataset[int(i)] for i in idx)
            return self._counted(items, epoch, [1] * len(idx))
        batch = self._batch()
        sizes = [min(batch, len(idx) - i) for i in range(0, len(idx), batch)]
        if self._loader.drop_last and sizes and sizes[-1] < batch:
            sizes.pop()
        self._order.items = idx.tolist()
        return self._counted(iter(self.loader), epoch, sizes)

    def _own_part(self) -> list[Any]:
        """This worker's part of the epoch the loader's own sampler (or batch sampler) draws:
        every worker draws the same order (torch's generator seeded by the shard's seed and
        the epoch), and takes every ``num_workers``-th item (sample or batch) from its id,
        padded by wrapping round so every worker takes as many (``DistributedSampler``'s
        contract)."""
        assert self._own is not None
        order = self._own.draw(self.seed, self.epoch)
        n = self.num_workers
        per_worker = -(-len(order) // n) if order else 0
        padded = (order * (-(-per_worker * n // len(order)))) if order else []
        return padded[: per_worker * n][self.worker_id :: n]

    def _counted(self, items: Iterable[Any], epoch: int, sizes: list[int]) -> Iterator[Any]:
        """``items``, counting this worker's samples of ``epoch``; logged when it ends."""
        self.samples.setdefault(epoch, 0)
        for item, size in zip(items, sizes, strict=False):
            self.samples[epoch] += size
            yield item
        plan = self.plan if self._elastic is not None else None
        log.info(
            "epoch %d: worker %d drew %d samples%s",
            epoch,
            self.worker_id,
            self.samples[epoch],
            ""
            if plan is None
            else f" (part {plan.rank} of {len(plan.members)}, members {list(plan.members)}"
            + (", repeating another's part: joined mid-epoch" if plan.repeats else "")
            + ")",
        )

    def _plan(self) -> EpochPlan:
        """The epoch in progress at the elastic client's step, and this worker's part."""
        client = self._elastic
        assert client is not None
        view = client.members(client.step)
        self.plan = plan_epoch(
            view,
            client.worker_id,
            len(self.dataset),
            self._batch(),
            self._drop_last(),
            self._first_step,
        )
        return self.plan

    def _batch(self) -> int:
        return (self._loader.batch_size or 1) if self._loader is not None else 1

    def _drop_last(self) -> bool:
        return bool(self._loader.drop_last) if self._loader is not None else False


def _is_loader(obj: Any) -> bool:
    try:
        from torch.utils.data import DataLoader
    except ImportError:
        return False
    return isinstance(obj, DataLoader)


class _Order:
    """The rebuilt loader's sampler (or batch sampler): the items this worker takes in the
    epoch being iterated, set before each epoch, so one loader (and its persistent workers)
    serves every epoch."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class _UserOrder:
    """A DataLoader's own sampler (a ``WeightedRandomSampler``, a custom one) or batch sampler,
    which ``shard`` splits instead of replacing: each epoch's draw, the same on every worker."""

    def __init__(self, source: Any, batches: bool, what: str) -> None:
        self.source = source
        self.batches = batches
        self.what = what

    @classmethod
    def of(cls, loader: Any) -> _UserOrder | None:
        """The loader's own order to split, or None for one made from ``shuffle`` (which
        ``shard`` replaces with the job's shuffle, as before)."""
        from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

        if loader.batch_size is None and loader.batch_sampler is not None:
            name = type(loader.batch_sampler).__name__
            return cls(loader.batch_sampler, True, f"batch_sampler ({name})")
        sampler = loader.sampler
        auto = type(sampler) is SequentialSampler or (
            type(sampler) is RandomSampler
            and not sampler.replacement
            and sampler._num_samples is None
        )
        batcher = loader.batch_sampler
        if batcher is not None and (
            type(batcher) is not BatchSampler or batcher.sampler is not sampler
        ):
            return cls(batcher, True, f"batch_sampler ({type(batcher).__name__})")
        if auto:
            return None
        return cls(sampler, False, f"sampler ({type(sampler).__name__})")

    def draw(self, seed: int, epoch: int) -> list[Any]:
        """One epoch of the source's order, drawn with torch's generator seeded by ``(seed,
        epoch)``: the same on every worker (a sampler with its own generator draws from it,
        the same on every worker of one script)."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]))
            if self.batches:
                return [list(b) for b in self.source]
            return list(self.source)

    def sizes(self, part: list[Any]) -> list[int]:
        """Samples per item of ``part`` (batches: their lengths)."""
        return [len(b) for b in part] if self.batches else [1] * len(part)


def _rebuild(loader: Any, order: _Order, batches: bool) -> Any:
    """``loader`` over ``order``, every setting kept: ``order`` as its batch sampler when it
    holds batches, else as its sampler under its ``batch_size`` and ``drop_last``.

    Raises:
        ValueError: torch refuses the settings (as it would the original loader's).
    """
    import inspect

    from torch.utils.data import DataLoader

    accepted = inspect.signature(DataLoader.__init__).parameters
    kept = {k: getattr(loader, k) for k in _KEPT if k in accepted and hasattr(loader, k)}
    if batches:
        return DataLoader(loader.dataset, batch_sampler=order, **kept)
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=order,
        drop_last=loader.drop_last,
        **kept,
    )


# A DataLoader's settings a sharded loader keeps (beside its dataset, batching and order).
_KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def start_epoch(client: Client, steps_per_epoch: int) -> int:
    """The epoch a resumed worker starts at: ``client.step // steps_per_epoch``.

    After ``init`` (or ``DistributedOptimizer(...)``) ``client.step`` is the step the shards
    hold for this worker: 0 for a new job, S for one resumed from a checkpoint at step S (the
    worker says so in a warning). Start the epoch loop there (``for epoch in
    range(start_epoch(client, len(batches)), epochs)``) and step an LR scheduler ``client.step``
    times, so a restarted script continues the run instead of replaying epoch 0.

    Raises:
        ValueError: ``steps_per_epoch`` < 1.
    """
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    return client.step // steps_per_epoch


def shard(
    dataset_or_loader: Any,
    client: _HasWorkers,
    *,
    seed: int = 0,
    shuffle: bool = True,
    first_step: int = 0,
) -> Sharded:
    """This worker's slice of a dataset or DataLoader (batches from a loader, items otherwise).

    Slices of different workers are disjoint (up to the padding that equalises their lengths),
    deterministic for a seed, and reshuffled each epoch with the seed shared by all workers.
    With an elastic client (``connect(elastic=...)``) the data is split among the members of
    each epoch, re-split at the next epoch boundary when members change, so every sample is
    still seen once per epoch (``psworker/epochs.py`` says what happens to the epoch in
    progress). ``first_step``: the step epoch 0 started at (elastic only).

    Raises:
        TypeError: an iterable-style dataset (no ``__len__``).
    """
    return Sharded(
        dataset_or_loader, client.worker_id, client.num_workers, seed, shuffle, client, first_step
    )
