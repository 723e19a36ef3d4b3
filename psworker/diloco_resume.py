"""A DiLoCo worker's own state on disk, so that a worker killed (kill -9) and restarted goes on
where it was (``connect(mode="diloco", worker_state_dir=...)``).

Between outer steps a DiLoCo worker holds what the shards do not: its local weights, its inner
optimizer's state (AdamW's moments) and its random generator. ``DiLoCoOptimizer`` writes them
here after every outer step has landed (nothing in flight), atomically (a temporary file, then
a rename: a kill mid-write leaves the one before). A restarted worker loads them when they are
this job's and this worker's, at the outer step the shards hold for it or the one before (it
died after its push reached them, before its write: its push of that step is sent again, and
the shards acknowledge it as a retry without applying it twice). It then redoes the same inner
steps on the same batches (the script's loop starts at ``client.step``), so in the synchronous
variant the job ends bit-identical to one without the fault. The script's own state (a
learning-rate scheduler's count, a GradScaler) is its own to restore.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pswire.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT = 1


@dataclass
class WorkerState:
    """What a DiLoCo worker holds between outer steps: the job and worker it belongs to, the
    outer steps landed (``outer_step``, the client's outer step), the inner steps taken, those
    since the last exchange started (``done``), the local weights and buffers (``model``), the
    inner optimizer's ``state_dict`` and the random generators' states."""

    job: str
    worker: int
    outer_step: int
    inner_step: int
    done: int
    model: dict[str, torch.Tensor]
    inner: dict[str, Any]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor]

    @staticmethod
    def generators() -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This process's random generators' states (CPU, and every CUDA device's)."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return torch.get_rng_state(), cuda

    def restore_generators(self) -> None:
        torch.set_rng_state(self.rng)
        if self.cuda_rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def save(self, path: Path) -> None:
        """Writes the state to ``path``, replacing the one before only once it is whole."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            torch.save({"format": FORMAT, **vars(self)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> WorkerState | None:
        """The state at ``path``; None when there is none.

        Raises:
            ConfigError: the file is not a worker state this version reads (named).
        """
        if not path.exists():
            return None
        try:
            saved = torch.load(path, weights_only=True)
            if saved.pop("format") != FORMAT:
                raise ValueError("another format")
            return cls(**saved)
        except Exception as exc:
            raise ConfigError(
                f"{path} is not a DiLoCo worker state this version reads ({exc}); move it away "
                "to start this worker afresh"
            ) from exc

    def check_resumable(
        self, job: str, worker: int, outer_step: int, elastic: bool = False
    ) -> bool:
        """Whether this state resumes worker ``worker`` of job ``job``, whose shards hold
        ``outer_step`` for it: False (logged) for another job's state, and in an ``elastic``
        job for a state behind the outer step the worker joined at (the job trained on
        without it: it starts from the job's weights as any joining worker, and the state is
        replaced at its next outer step).

        Raises:
            ConfigError: another worker's state, or an outer step neither the shards' nor the
                one before (the shards were restored from an older checkpoint, or the state
                is from elsewhere): training on would not be this worker's run.
        """
        if self.job != job:
            log.warning(
                "worker %d: ignoring the DiLoCo worker state of job %s (this job is %s)",
                worker,
                self.job,
                job,
            )
            return False
        if self.worker != worker:
            raise ConfigError(
                f"the DiLoCo worker state holds worker {self.worker}'s, not worker {worker}'s"
            )
        if elastic and self.outer_step < outer_step:
            # A restarted process joins afresh: it is not a member at the steps it left.
            log.warning(
                "worker %d rejoined the elastic job at outer step %d; its DiLoCo state from "
                "outer step %d is set aside (the job trained on without it): it starts from "
                "the job's weights and a fresh inner optimizer, as a joining worker does",
                worker,
                outer_step,
                self.outer_step,
            )
            return False
        if not outer_step - 1 <= self.outer_step <= outer_step:
            raise ConfigError(
                f"worker {worker}'s DiLoCo state is at outer step {self.outer_step}, but the "
                f"shards hold outer step {outer_step} for it (they resume from the state's step "
                "or the one after it): the shards or the state come from another point of the "
                "run, and resuming would not be this worker's training. Restart the job from a "
                "checkpoint, or move the state away to start this worker afresh"
            )
        return True
