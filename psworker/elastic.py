"""``ElasticPSClient``: a worker of an elastic job, joining it while it runs.

An elastic job has a minimum and a maximum of members. A worker joins at the step the shards
are in (it pulls the current weights; nothing is initialised again), and leaves with ``close()``
or by failing (the shards drop it after their heartbeat timeout). Joining is two-phase across
the shards (see ``psserver/elastic.py``), so every shard counts it from the same step. No step
opens with fewer members than the minimum: until enough have joined, pulls and pushes wait,
and end at their deadline with an error naming who is missing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence

import numpy as np

from pscore.optim import Optimizer
from pscore.tables import Table
from pswire.errors import ConfigError, PSError, WaitTimeoutError
from pswire.proto import ps_pb2
from psworker.api import Members
from psworker.client import PSClient
from psworker.settings import ClientSettings

log = logging.getLogger(__name__)
# Each refused prepare means a shard opened the step meanwhile; shards are at most a step or
# two apart, so a few tries always settle on a step every shard still takes.
JOIN_ATTEMPTS = 8
Phase = ps_pb2.JoinRequest.Phase


def parse_bounds(text: str, source: str = "elastic") -> tuple[int, int]:
    """``"MIN:MAX"`` (or one number N, meaning N:N) as (min, max).

    Raises:
        ConfigError: not two integers with 1 <= MIN <= MAX.
    """
    lo, sep, hi = text.strip().partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise ConfigError(f"{source}={text!r} is not MIN:MAX (e.g. 2:4)") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"{source}={text!r}: needs 1 <= MIN <= MAX")
    return bounds


class ElasticPSClient(PSClient):
    """A ``PSClient`` of an elastic job of ``settings.min_workers`` to ``max_workers``
    members.

    Worker ids are in ``[0, max_workers)`` (``num_workers`` is ``max_workers``); ``members()``
    says who trains at a step. ``init`` joins: ``step`` is then the step this worker starts
    at, and ``joined_at`` the same.

    Raises:
        ConfigError: settings of a job of fixed size (no ``min_workers``/``max_workers``).
    """

    _elastic_job = True

    def __init__(self, settings: ClientSettings) -> None:
        super().__init__(settings)
        self.joined_at: int | None = None

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer | Sequence[Optimizer],
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
        fixed: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """``PSClient.init``, then joins the job at the step the shards are in: the next
        ``pull`` reads the job's current weights (worker 0's initial ones at step 0).

        Raises:
            WaitTimeoutError: the shards kept opening steps before every one took the join.
            PSError: as ``PSClient.init``.
        """
        super().init(variables, optimizer, buffers, tables, groups, fixed)
        try:
            self.step = self.joined_at = self._join()
        except BaseException:
            self.shards.settle(lambda s: self._join_call(s, Phase.ABORT, 0))
            raise

    def members(self, step: int | None = None) -> Members:
        """Who trains at ``step`` (default: this worker's next), once it may be read there,
        and every change of members before it, as shard 0 recorded them.

        Raises:
            WaitTimeoutError: ``step`` did not open in time (too few members: the message
                names who is missing).
            PSError: any other failure.
        """
        at = self.step if step is None else step
        request = ps_pb2.ListMembersRequest(worker_id=self.worker_id, step=at)
        link = self.links[0]
        reply = link.call(
            "ListMembers", lambda stub: stub.ListMembers(request, timeout=self.timeout)
        )
        return Members(
            at,
            tuple(reply.members),
            tuple((int(r.step), tuple(r.members)) for r in reply.rosters),
            int(reply.min_workers),
            int(reply.max_workers),
        )

    def _join(self) -> int:
        """The two-phase join on every shard; returns the step joined at.

        Raises:
            WaitTimeoutError: no step every shard takes after JOIN_ATTEMPTS prepares.
            PSError: a shard refused the join (the job is not elastic, ...).
        """
        proposed = self._fan_out(lambda s: self._join_call(s, Phase.PROPOSE, 0))
        step = max(int(r.step) for r in proposed)
        tried = []
        for _ in range(JOIN_ATTEMPTS):
            tried.append(step)
            replies = self._fan_out(functools.partial(self._prepare, step=step))
            refused = [int(r.step) for r in replies if not r.accepted]
            if not refused:
                break
            step = max(step + 1, *refused)
        else:
            raise WaitTimeoutError(
                f"worker {self.worker_id} could not join: each step it prepared ({tried}) had "
                "opened on some shard before every shard took it"
            )
        committed = self._fan_out(lambda s: self._join_call(s, Phase.COMMIT, step))
        log.info(
            "worker %d joined the elastic job at step %d; members now %s",
            self.worker_id,
            step,
            list(committed[0].members),
        )
        return step

    def _prepare(self, shard: int, step: int) -> ps_pb2.JoinResponse:
        return self._join_call(shard, Phase.PREPARE, step)

    def _join_call(
        self, shard: int, phase: ps_pb2.JoinRequest.Phase.ValueType, step: int
    ) -> ps_pb2.JoinResponse:
        request = ps_pb2.JoinRequest(
            worker_id=self.worker_id, session=self.session, phase=phase, step=step
        )
        link = self.links[shard]
        try:
            return link.call("Join", lambda stub: stub.Join(request, timeout=self.timeout))
        except PSError:
            if phase == Phase.ABORT:
                return ps_pb2.JoinResponse()  # best effort: the shard drops it when silent
            raise
