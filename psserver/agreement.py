"""Which job a shard serves: worker 0's. Every other worker's declaration is checked against it,
and the one that differs is the one told so."""

from __future__ import annotations

import logging
from dataclasses import replace

from pscore.job import Job, keeping_fixed
from pswire.errors import ModelMismatchError
from pswire.piecekey import parse_piece_key

log = logging.getLogger(__name__)


class JobAgreement:
    """The job of one shard and the workers whose earlier declaration lost to worker 0's;
    not thread-safe (the shard's lock guards it).

    A job declared by worker 0 (or restored from a checkpoint) is the job. One declared by
    another worker before worker 0 is provisional: the shard serves it meanwhile (nothing is
    trained before worker 0's initial values arrive), and when worker 0's differs, worker 0's
    replaces it and every worker that declared something else is refused from then on, with the
    difference named.

    A job restored from a checkpoint keeps its model, mode and optimizer classes, but the
    first worker 0 to declare after the restore may change the optimizers' hyper-parameters
    (a smaller learning rate after a refused step: they are per-update values anyway, and
    torch's state does not depend on them); what would change which optimizer state exists
    stays fixed. Until worker 0 declares, the others' declarations are provisional, as above.
    """

    def __init__(self) -> None:
        self.job: Job | None = None
        self._settled = False  # the job is worker 0's (or a checkpoint's)
        self._restored = False  # a checkpoint's job, worker 0 not heard since
        self._declared: dict[int, Job] = {}  # provisional declarations, until worker 0's
        self._refused: dict[int, str] = {}

    def declare(self, worker: int, job: Job, started: bool = False) -> bool:
        """Worker ``worker`` says the job is ``job``; True when the shard's job (changed and)
        needs its rule rebuilt. ``started``: this worker has pushed steps of the job before (it
        restarts, or the job was restored), so the values workers never send are not compared
        (``keeping_fixed``): its script may have changed them since.

        Raises:
            ModelMismatchError: ``job`` differs from worker 0's (or from the checkpoint's in
                more than hyper-parameters).
        """
        if started and self.job is not None:
            job = keeping_fixed(job, self.job)
        if self._restored:
            return self._declare_after_restore(worker, job)
        if worker == 0 and not self._settled:
            changed = self.job is None or bool(job.differences(self.job))
            self.job = job
            self._settled = True
            self._judge_declared("worker 0's")
            self._refused.pop(0, None)
            return changed
        if self.job is None:
            self.job = job
            self._declared[worker] = job
            return True
        if not self._settled:
            self._declared[worker] = job  # judged when worker 0 declares
            return False
        diffs = _differences(job, self.job)
        if diffs:
            # Said to this caller now; not kept: a refused declaration changes nothing.
            holder = "the one an earlier worker 0 declared" if worker == 0 else "worker 0's"
            raise ModelMismatchError(_mismatch(worker, diffs, holder))
        self._refused.pop(worker, None)
        return False

    def _declare_after_restore(self, worker: int, job: Job) -> bool:
        assert self.job is not None
        diffs = _differences(job, self.job)
        if diffs and not _values_only(job, self.job):
            raise ModelMismatchError(_mismatch(worker, diffs, "the job in this shard's checkpoint"))
        if worker != 0:
            self._declared[worker] = job  # judged when worker 0 declares
            return False
        if diffs:
            log.warning(
                "worker 0 restarts the restored job with other hyper-parameters: %s",
                "; ".join(diffs),
            )
            self.job = replace(self.job, optimizer=job.optimizer, groups=job.groups)
        self._restored = False
        self._judge_declared("worker 0's")
        self._refused.pop(0, None)
        return False

    def _judge_declared(self, holder: str) -> None:
        """Refuses, from now on, every provisional declaration that differs from the job."""
        assert self.job is not None
        for other, declared in self._declared.items():
            diffs = _differences(declared, self.job)
            if diffs:
                self._refused[other] = _mismatch(other, diffs, holder)
            else:
                self._refused.pop(other, None)
        self._declared.clear()

    @classmethod
    def restored(cls, job: Job) -> JobAgreement:
        """The agreement of a shard restored from a checkpoint: the job it holds is the job
        (its hyper-parameters open to worker 0)."""
        agreement = cls()
        agreement.job = job
        agreement._settled = True
        agreement._restored = True
        return agreement

    def awaiting(self, worker: int) -> bool:
        """Whether ``worker`` declared other hyper-parameters than a restored job's, before
        worker 0 (who may change them) declared."""
        declared = self._declared.get(worker) if self._restored else None
        return (
            declared is not None and self.job is not None and bool(declared.differences(self.job))
        )

    def check(self, worker: int) -> None:
        """Raises ModelMismatchError for a worker whose declared job is not the job."""
        refused = self._refused.get(worker)
        if refused is not None:
            raise ModelMismatchError(refused)


def _values_only(mine: Job, theirs: Job) -> bool:
    """Whether ``mine`` differs from ``theirs`` only in per-update hyper-parameters: the same
    optimizer classes with the same state layout (e.g. momentum on in both)."""
    if len(mine.optimizers) != len(theirs.optimizers):
        return False
    for a, b in zip(mine.optimizers, theirs.optimizers, strict=True):
        if type(a) is not type(b) or a.layout() != b.layout():
            return False
    return not replace(mine, optimizer=theirs.optimizer, groups=theirs.groups).differences(theirs)


def _differences(job: Job, held: Job) -> list[str]:
    """``job.differences(held)``, led by why where the two cut the same variables into other
    slices (a mismatch names ten differences at most, and the slices would fill them)."""
    diffs = job.differences(held)
    mine, theirs = {v.key for v in job.variables}, {v.key for v in held.variables}
    if mine != theirs and _whole(mine) == _whole(theirs):
        diffs.insert(
            0,
            "the same variables, cut into other slices: the worker's split_bytes or part_bytes "
            "differ from those the job was placed with (every worker, and every restart of "
            "the job, must pass the same)",
        )
    return diffs


def _whole(keys: set[str]) -> set[str]:
    """The variables that piece keys are slices of."""
    return {piece[0] if (piece := parse_piece_key(k)) else k for k in keys}


def _mismatch(worker: int, diffs: list[str], holder: str) -> str:
    return f"worker {worker}'s job differs from {holder}, which this shard holds: " + "; ".join(
        diffs[:10]
    )
