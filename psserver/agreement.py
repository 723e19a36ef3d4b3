"""Which job a shard serves: worker 0's. Every other worker's declaration is checked against it,
and the one that differs is the one told so."""

from __future__ import annotations

from pswire.errors import ModelMismatchError
from pswire.job import Job


class JobAgreement:
    """The job of one shard and the workers whose earlier declaration lost to worker 0's;
    not thread-safe (the shard's lock guards it).

    A job declared by worker 0 (or restored from a checkpoint) is the job. One declared by
    another worker before worker 0 is provisional: the shard serves it meanwhile (nothing is
    trained before worker 0's initial values arrive), and when worker 0's differs, worker 0's
    replaces it and every worker that declared something else is refused from then on, with the
    difference named.
    """

    def __init__(self) -> None:
        self.job: Job | None = None
        self._settled = False  # the job is worker 0's (or a checkpoint's)
        self._declared: dict[int, Job] = {}  # provisional declarations, until worker 0's
        self._refused: dict[int, str] = {}

    def declare(self, worker: int, job: Job) -> bool:
        """Worker ``worker`` says the job is ``job``; True when the shard's job (changed and)
        needs its rule rebuilt.

        Raises:
            ModelMismatchError: ``job`` differs from worker 0's.
        """
        if worker == 0 and not self._settled:
            changed = self.job is None or bool(job.differences(self.job))
            self.job = job
            self._settled = True
            for other, declared in self._declared.items():
                diffs = declared.differences(job)
                if diffs:
                    self._refused[other] = _mismatch(other, diffs)
            self._declared.clear()
            self._refused.pop(0, None)
            return changed
        if self.job is None:
            self.job = job
            self._declared[worker] = job
            return True
        if not self._settled:
            self._declared[worker] = job  # judged when worker 0 declares
            return False
        diffs = job.differences(self.job)
        if diffs:
            # Said to this caller now; not kept: a refused declaration changes nothing.
            raise ModelMismatchError(_mismatch(worker, diffs))
        self._refused.pop(worker, None)
        return False

    def restore(self, job: Job) -> None:
        """The job a checkpoint holds is the job."""
        self.job = job
        self._settled = True

    def check(self, worker: int) -> None:
        """Raises ModelMismatchError for a worker whose declared job is not the job."""
        refused = self._refused.get(worker)
        if refused is not None:
            raise ModelMismatchError(refused)


def _mismatch(worker: int, diffs: list[str]) -> str:
    return f"worker {worker}'s job differs from worker 0's, which this shard holds: " + "; ".join(
        diffs[:10]
    )
