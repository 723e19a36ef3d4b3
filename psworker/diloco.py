"""Local steps with an outer optimizer on the shards (DiLoCo, Douillard et al. 2023): the settings
(``DiLoCoSettings``), the client a ``mode="diloco"`` job gets (``DiLoCoClient``) and the outer
step (``OuterSteps``), in numpy; ``psworker/torch_diloco.py`` drives them from a torch model.

Each worker takes ``local_steps`` (H) steps with its own (inner) optimizer on its own copy of
the weights; then it pushes the pseudo-gradient, the job's weights at the last outer step minus
its own now, and loads the job's new weights. The shards run the outer optimizer on it through
an existing consistency rule, so they need not know the mode: with ``outer_sync`` (default) in
``sync`` (each shard averages the pseudo-gradients of the outer step's live workers and applies
the outer optimizer once: workers that join or leave do so between outer steps, and a shard's
kill -9 recovers bit-identically as with gradients: a pseudo-gradient push is an ordinary push,
kept for replay), else in ``async`` (each pseudo-gradient applied on arrival; an outer SGD with
Nesterov momentum runs as ``DelayedNesterov`` with ``delay`` = the number of workers, so
momentum moves once per full set of workers' updates; with ``dynamic_local_steps`` each
worker's local steps are scaled by its pace, DyLU: ``DynamicLocalSteps``). H, the inner
optimizer's settings and the variant are part of the job: a worker that differs is refused,
naming both.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from pscore.job import VARIANT_MARK
from pscore.optim import SGD, Optimizer
from pscore.optspec import StepOptions
from pscore.outer import DelayedNesterov
from pscore.tables import RowSparse, Table
from pswire.errors import ConfigError
from psworker.client import PSClient
from psworker.outgoing import wire_nbytes

log = logging.getLogger(__name__)

# The paper's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9.
PAPER_OUTER = SGD(lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class DiLoCoSettings:
    """How a ``mode="diloco"`` job trains.

    ``local_steps``: H, the inner steps between outer steps (>= 1). ``outer``: the optimizer
    the shards apply to the pseudo-gradients (any server-side optimizer; default the paper's
    Nesterov SGD). ``outer_sync``: the shards average each outer step's pseudo-gradients of
    every live worker before one outer update (``sync``); False applies each on arrival
    (``async``: no barrier between slow and fast workers), with the delayed Nesterov rule for
    an outer Nesterov SGD. ``dynamic_local_steps`` (asynchronous only): Dynamic Local Updates
    (Liu et al. 2024): ``local_steps`` is the fastest worker's, and each worker takes that
    many scaled by its pace against the fastest live worker's (a worker half as fast takes
    half as many), so all reach their outer steps at about the same time and no worker's
    pseudo-gradient is many outer steps stale.

    Streaming DiLoCo (Douillard et al. 2025): ``fragments`` (P, dividing ``local_steps``)
    splits the trained variables, in the model's order, into P contiguous parts of about equal
    size (buffers travel with the last); each part still takes its outer step every H inner
    steps, but the parts' outer steps are staggered by H/P inner steps, so each exchange moves
    1/P of the model. ``overlap_steps`` (tau, < H/P): a part's exchange runs in the
    background while tau more inner steps run; its new weights then land merged with the local
    ones as ``mix * local + (1 - mix) * job's`` (``mix`` 0: replaced, as without overlap).
    Fragments and overlap are not combined with ``dynamic_local_steps``.
    """

    local_steps: int = 1
    outer: Optimizer = field(default_factory=lambda: PAPER_OUTER)
    outer_sync: bool = True
    dynamic_local_steps: bool = False
    fragments: int = 1
    overlap_steps: int = 0
    mix: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int):
            raise ConfigError(f"local_steps must be an int >= 1, got {self.local_steps!r}")
        if self.local_steps < 1:
            raise ConfigError(f"local_steps must be >= 1, got {self.local_steps}")
        if not isinstance(self.outer, Optimizer):
            raise ConfigError(
                f"outer must be a server-side optimizer (psworker.SGD(...), ...), got "
                f"{type(self.outer).__name__}"
            )
        if not isinstance(self.outer_sync, bool):
            raise ConfigError(f"outer_sync must be True or False, got {self.outer_sync!r}")
        if not isinstance(self.dynamic_local_steps, bool):
            raise ConfigError(
                f"dynamic_local_steps must be True or False, got {self.dynamic_local_steps!r}"
            )
        if self.dynamic_local_steps and self.outer_sync:
            raise ConfigError(
                "dynamic_local_steps=True scales each worker's local steps by its pace, an "
                "option of the asynchronous outer steps: pass outer_sync=False (got "
                "outer_sync=True)"
            )
        self._check_streaming()

    def _check_streaming(self) -> None:
        for name in ("fragments", "overlap_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if not 1 <= self.fragments <= self.local_steps or self.local_steps % self.fragments:
            raise ConfigError(
                f"fragments must divide local_steps (each fragment's outer step falls "
                f"local_steps/fragments inner steps after the one before): got fragments="
                f"{self.fragments}, local_steps={self.local_steps}"
            )
        if not 0 <= self.overlap_steps < self.spacing:
            raise ConfigError(
                f"overlap_steps must be >= 0 and below local_steps/fragments = {self.spacing} "
                f"(one exchange in flight at a time), got {self.overlap_steps}"
            )
        if isinstance(self.mix, bool) or not isinstance(self.mix, int | float):
            raise ConfigError(f"mix must be a number in [0, 1), got {self.mix!r}")
        if not 0.0 <= self.mix < 1.0:
            raise ConfigError(
                f"mix must be in [0, 1) (the local weights' share when a fragment's new "
                f"weights land), got {self.mix}"
            )
        if self.dynamic_local_steps and (self.fragments > 1 or self.overlap_steps):
            raise ConfigError(
                "dynamic_local_steps=True cannot be combined with fragments or overlap_steps "
                f"(got fragments={self.fragments}, overlap_steps={self.overlap_steps})"
            )

    @property
    def spacing(self) -> int:
        """Inner steps between two exchanges (of consecutive fragments): H / P."""
        return self.local_steps // self.fragments

    @property
    def shard_mode(self) -> str:
        """The shards' consistency rule for the outer steps."""
        return "sync" if self.outer_sync else "async"

    def shard_optimizer(self, num_workers: int) -> Optimizer:
        """The optimizer the shards run: ``outer``, or in async its delayed-Nesterov form."""
        o = self.outer
        if not self.outer_sync and isinstance(o, SGD) and o.nesterov:
            if o.weight_decay:
                raise ConfigError(
                    "asynchronous DiLoCo runs an outer Nesterov SGD as DelayedNesterov, which "
                    f"has no weight decay; got weight_decay={o.weight_decay}"
                )
            return DelayedNesterov(lr=o.lr, momentum=o.momentum, delay=num_workers)
        return o

    def variant(self, inner: str) -> str:
        """What the job's workers must agree on beside the model (``inner``: the inner
        optimizer described), appended to the model digest."""
        dynamic = ", dynamic_local_steps=True" if self.dynamic_local_steps else ""
        streaming = (
            f", fragments={self.fragments}, overlap_steps={self.overlap_steps}, mix={self.mix}"
            if (self.fragments, self.overlap_steps, self.mix) != (1, 0, 0.0)
            else ""
        )
        return (
            f"{VARIANT_MARK}diloco(local_steps={self.local_steps}, "
            f"outer_sync={self.outer_sync}{dynamic}{streaming}, inner={inner})"
        )


class DiLoCoClient:
    """A worker's client in ``mode="diloco"``: the ``PSClient`` of the outer steps, counted in
    inner steps.

    ``step`` counts inner steps (``outer.step * local_steps / fragments`` after ``init``), so
    ``shard()`` and ``start_epoch`` see one step per batch; ``outer`` is the parameter-server
    client, whose step is the outer step (one per fragment's exchange).
    ``bytes_sent``/``bytes_received`` total what outer steps moved (pseudo-gradients as
    compressed on the wire, weights read back). ``state_dir``: where this worker keeps its
    own state (``state_file``) to resume after a restart (``psworker/diloco_resume.py``).
    """

    mode = "diloco"

    def __init__(
        self,
        outer: PSClient,
        settings: DiLoCoSettings,
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if outer.mode != settings.shard_mode:
            raise ConfigError(
                f"DiLoCo with outer_sync={settings.outer_sync} runs the shards in mode "
                f"{settings.shard_mode!r}; the client given runs {outer.mode!r}"
            )
        self.outer = outer
        self.settings = settings
        self.worker_id = outer.worker_id
        self.num_workers = outer.num_workers
        self.step = outer.step * settings.spacing
        self.in_flight: Future[Any] | None = None  # an overlapped exchange (OuterSteps)
        # This worker's own state, kept to resume after a restart (psworker/diloco_resume.py).
        self.state_file = (
            None if state_dir is None else Path(state_dir) / f"diloco-worker-{self.worker_id}.pt"
        )
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def last_skipped(self) -> bool:
        return self.outer.last_skipped

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the links, once an overlapped exchange still in flight has ended (within
        its deadline; its failure is logged: the script did not call ``synchronize``)."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            try:
                flight.result(timeout=self.outer.settings.timeout)
            except Exception as exc:  # closing anyway; the exchange's own error is the news
                log.warning(
                    "worker %d: an outer step in flight at close failed: %s", self.worker_id, exc
                )
        self.outer.close()

    def declare(self, inner: str) -> None:
        """Makes the inner optimizer (described) part of the job the next ``init`` declares."""
        self.outer.variant = self.settings.variant(inner)

    def init(
        self,
        variables: Mapping[str, np.ndarray],
        optimizer: Optimizer | Sequence[Optimizer] | None = None,
        buffers: Sequence[str] = (),
        tables: Mapping[str, Table] | None = None,
        groups: Mapping[str, int] | None = None,
        fixed: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """``PSClient.init`` with the outer optimizer (``optimizer`` must be None or it):
        worker 0's values become the job's first weights.

        Raises:
            ConfigError: embedding tables, an optimizer other than the outer one, or fewer
                trained variables than fragments.
            PSError: as ``PSClient.init`` (ModelMismatchError names a differing H or inner
                optimizer).
        """
        if tables:
            raise ConfigError(
                f"mode 'diloco' trains dense variables only; got embedding tables {sorted(tables)}"
            )
        # Before anything is sent: the fragments need as many trained variables.
        split_fragments(
            {n: int(np.size(v)) for n, v in variables.items() if n not in set(buffers)},
            self.settings.fragments,
        )
        outer = self.settings.shard_optimizer(self.num_workers)
        if optimizer is not None and optimizer not in (outer, self.settings.outer):
            raise ConfigError(
                f"in mode 'diloco' the shards run the outer optimizer {self.settings.outer}; "
                f"init got {optimizer} (the inner optimizer runs in the worker)"
            )
        self.outer.init(variables, outer, buffers=buffers, fixed=fixed)
        self.step = self.outer.step * self.settings.spacing

    def pull(
        self, names: Sequence[str] | None = None, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """The job's weights as of the last outer step."""
        return self.outer.pull(names, out)

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        raise ConfigError("mode 'diloco' has no embedding tables")

    def push(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        options: StepOptions | None = None,
    ) -> bool:
        """One outer step's pseudo-gradients (global minus local weights): see ``OuterSteps``."""
        return self.outer.push(grads, step, options)

    def push_pull(
        self,
        grads: Mapping[str, np.ndarray | RowSparse],
        step: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        options: StepOptions | None = None,
        rows: Mapping[str, np.ndarray | Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """One outer step's pseudo-gradients pushed, the new weights pulled."""
        return self.outer.push_pull(grads, step, out, options, rows)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """The outer optimizer's slots on the shards."""
        return self.outer.optimizer_state()

    def load_state(
        self,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        digest: str,
    ) -> None:
        self.outer.load_state(values, slots, digest)

    def status(self) -> Any:
        """The shards' Status (``PSClient.status``)."""
        return self.outer.status()

    def pace(self, seconds_per_step: float) -> float:
        """Tells the shards this worker's pace (seconds per inner step); returns the fastest
        live worker's they know (0: none). One heartbeat to each shard.

        Raises:
            PSError: as ``PSClient.heartbeat``.
        """
        return self.outer.heartbeat(seconds_per_step)


def dynamic_local_steps(most: int, own: float, fastest: float) -> int:
    """DyLU's local steps for a worker that takes ``own`` seconds per inner step when the
    fastest live worker takes ``fastest``: ``most`` (the fastest worker's) scaled by
    ``fastest / own``, rounded, within ``[1, most]``; ``most`` while either is unknown (0)."""
    if own <= 0 or fastest <= 0 or fastest >= own:
        return most
    return max(1, round(most * (fastest / own)))


class PaceMeter:
    """A worker's pace, seconds per inner step, timed between outer steps (the outer step's own
    push and pull left out): the median of the last ``window`` outer steps' means, so one
    slow stretch (an evaluation, a pause) does not halve the next outer step's local steps.
    ``clock`` is injected for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: int = 3) -> None:
        self._clock = clock
        self._since = clock()
        self._recent: deque[float] = deque(maxlen=window)

    def lap(self, steps: int) -> float:
        """The inner steps since ``restart`` (or construction) were ``steps``; the pace now."""
        self._recent.append((self._clock() - self._since) / max(1, steps))
        return statistics.median(self._recent)

    def restart(self) -> None:
        """Inner steps start again now (after an outer step)."""
        self._since = self._clock()


class DynamicLocalSteps:
    """Dynamic Local Updates: how many inner steps the next outer step waits for (``due``),
    from this worker's pace (``PaceMeter``) and the fastest live worker's, which the shards
    relay (``DiLoCoClient.pace``). Every worker starts with ``most``; at each outer step it
    times its inner steps (``lap``, before the push), and after the push and pull says its pace
    and takes ``dynamic_local_steps(most, own, fastest)`` steps next (``update``)."""

    def __init__(
        self, client: DiLoCoClient, most: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.client = client
        self.most = most
        self.due = most
        self.meter = PaceMeter(clock)

    def lap(self, steps: int) -> float:
        """This worker's pace, the ``steps`` inner steps since the last outer step counted."""
        return self.meter.lap(steps)

    def update(self, own: float) -> None:
        """After the outer step's push and pull: reports ``own``, sets ``due``, and starts
        timing the next inner steps.

        Raises:
            PSError: the pace could not be reported (as ``DiLoCoClient.pace``).
        """
        fastest = self.client.pace(own)
        self.due = dynamic_local_steps(self.most, own, fastest)
        self.meter.restart()


def split_fragments(sizes: Mapping[str, int], count: int) -> list[list[str]]:
    """Streaming DiLoCo's fragments: the variables of ``sizes`` (name -> elements, in the
    model's order) in ``count`` contiguous non-empty parts, each cut once it holds its share
    of the elements (the first parts the earlier layers).

    Raises:
        ConfigError: fewer variables than fragments.
    """
    names = list(sizes)
    if len(names) < count:
        raise ConfigError(
            f"fragments={count} needs at least as many trained variables; the model has "
            f"{len(names)}: {names}"
        )
    total = sum(sizes.values())
    parts: list[list[str]] = [[]]
    held = 0
    for i, name in enumerate(names):
        must_open = len(names) - i == count - len(parts)  # one name left for each part to come
        if parts[-1] and len(parts) < count and (held >= total * len(parts) / count or must_open):
            parts.append([])
        parts[-1].append(name)
        held += sizes[name]
    return parts


@dataclass(frozen=True)
class Landed:
    """One outer step (a fragment's exchange) that has landed: its outer step number, the
    seconds it took from its start, and the bytes it sent and received."""

    step: int
    seconds: float
    sent: int
    received: int


@dataclass
class _Flight:
    """An exchange in progress: its outer step, fragment and names, what the shards return."""

    step: int
    names: list[str]
    started: float
    sent: int
    reply: Future[dict[str, np.ndarray]]
    left: int  # inner steps until it lands


class OuterSteps:
    """Counts a worker's inner steps and takes the outer steps they make due: every
    ``local_steps``-th (with dynamic local steps: every ``dynamic.due``-th), or with
    ``fragments`` one fragment's every ``local_steps / fragments``-th, in turn.

    Holds the job's weights as of each variable's last outer step (``start``); an outer step
    pushes ``start - local`` for a fragment's trained variables (all of them without
    fragments; buffers, as they are, with the last: the shards keep their mean in sync),
    reads the job's new values, which become their start, and merges them into the local
    weights (``mix``). With ``overlap_steps`` the exchange runs on a thread of its own while
    that many inner steps run, and lands at the inner step after them. ``order``: the trained
    variables in the model's order (default: ``start``'s). ``clock`` times the inner steps
    for dynamic local steps (injected for tests).
    """

    def __init__(
        self,
        client: DiLoCoClient,
        start: Mapping[str, np.ndarray],
        buffers: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
        order: Sequence[str] | None = None,
    ) -> None:
        self.client = client
        self.buffers = frozenset(buffers)
        self.start = {n: np.array(a, copy=True) for n, a in start.items() if n not in self.buffers}
        self.done = 0  # inner steps since the last exchange started
        settings = client.settings
        self.settings = settings
        ordered = [n for n in (order or ()) if n in self.start]
        placed = set(ordered)
        trained = ordered + [n for n in self.start if n not in placed]  # none left out
        self.fragments = split_fragments(
            {n: int(self.start[n].size) for n in trained}, settings.fragments
        )
        self.fragments[-1] += sorted(self.buffers)
        self.outer_step_count = client.outer.step  # exchanges started, this worker's
        self._flight: _Flight | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.dynamic = (
            DynamicLocalSteps(client, settings.local_steps, clock)
            if settings.dynamic_local_steps
            else None
        )

    @property
    def in_flight(self) -> bool:
        """Whether an exchange has started and not landed."""
        return self._flight is not None

    def resume(self, outer_step: int, done: int, inner_step: int) -> None:
        """Goes on from a worker's saved state: ``outer_step`` exchanges landed, ``done``
        inner steps since the last one started, ``inner_step`` in all (the client's counts
        set to match: a push of an outer step the shards already hold is sent as a retry)."""
        self.outer_step_count = outer_step
        self.done = done
        self.client.outer.step = outer_step
        self.client.step = inner_step

    @property
    def due(self) -> int:
        """The inner steps between exchanges (``local_steps`` unless fragments or dynamic
        local steps make them fewer)."""
        return self.dynamic.due if self.dynamic is not None else self.settings.spacing

    def inner_step(self) -> bool:
        """Counts one inner step; whether ``outer_step`` has work now (an exchange to start
        or one to land)."""
        self.done += 1
        self.client.step += 1
        if self._flight is not None:
            self._flight.left -= 1
        return self.done >= self.due or (self._flight is not None and self._flight.left <= 0)

    def outer_step(
        self, read: Callable[[Sequence[str]], Mapping[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], list[Landed]]:
        """What is due at this inner step: lands the exchange whose overlap has run out, and
        starts the next fragment's (without overlap: waits for it and lands it too).
        ``read(names)``: the local values of those variables. Returns the values to load into
        the model (merged as ``mix`` says; buffers the job's) and the outer steps landed.

        Raises:
            ConfigError: ``read`` lacks a variable.
            PSError: the push or pull failed (as ``PSClient.push_pull``).
        """
        loads: dict[str, np.ndarray] = {}
        landed: list[Landed] = []
        if self._flight is not None and self._flight.left <= 0:
            landed.append(self._land(read, loads))
        if self.done >= self.due:
            names = self.fragments[self.outer_step_count % len(self.fragments)]
            self._start(names, read)
            if self._flight is not None and self._flight.left <= 0:
                landed.append(self._land(read, loads))
        return loads, landed

    def flush(
        self, read: Callable[[Sequence[str]], Mapping[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], list[Landed]]:
        """Lands the exchange in flight, then takes one outer step of every variable for the
        inner steps since the last exchange (none: nothing more), as ``outer_step``."""
        loads: dict[str, np.ndarray] = {}
        landed: list[Landed] = []
        if self._flight is not None:
            landed.append(self._land(read, loads))
        if self.done:
            self._start([n for part in self.fragments for n in part], read, now=True)
            landed.append(self._land(read, loads))
        return loads, landed

    def _start(
        self,
        names: list[str],
        read: Callable[[Sequence[str]], Mapping[str, np.ndarray]],
        now: bool = False,
    ) -> None:
        """Pushes the pseudo-gradients of ``names`` and reads their new values, on the
        flight thread when overlapped (unless ``now``)."""
        local = read(names)
        missing = sorted(set(names) - set(local))
        if missing:
            raise ConfigError(f"the outer step lacks the local weights of {missing}")
        own = self.dynamic.lap(self.done) if self.dynamic is not None else 0.0
        pushed: dict[str, np.ndarray | RowSparse] = {
            n: local[n] if n in self.buffers else self.start[n] - local[n] for n in names
        }
        compression = self.client.outer.compression
        sent = sum(
            int(v.nbytes if n in self.buffers else wire_nbytes(np.asarray(v), compression))
            for n, v in pushed.items()
        )
        whole = len(names) == len(self.start) + len(self.buffers)
        client = self.client

        def exchange() -> dict[str, np.ndarray]:
            if whole:  # one message each way where it fits
                return client.push_pull(pushed)
            client.push(pushed)
            return client.pull(names)

        overlap = 0 if now else self.settings.overlap_steps
        reply: Future[dict[str, np.ndarray]]
        if overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="diloco-outer")
            reply = self._pool.submit(exchange)
            client.in_flight = reply
        else:
            reply = Future()
            reply.set_result(exchange())
        self._flight = _Flight(
            self.outer_step_count, names, time.perf_counter(), sent, reply, overlap
        )
        self.outer_step_count += 1
        self.done = 0
        if self.dynamic is not None:
            self.dynamic.update(own)

    def _land(
        self,
        read: Callable[[Sequence[str]], Mapping[str, np.ndarray]],
        loads: dict[str, np.ndarray],
    ) -> Landed:
        """Waits for the exchange in flight and merges its values into ``loads``."""
        flight, self._flight = self._flight, None
        assert flight is not None
        try:
            weights = flight.reply.result()
        finally:
            self.client.in_flight = None
        trained = [n for n in flight.names if n not in self.buffers]
        mix = self.settings.mix
        local = read(trained) if mix else {}
        for name in flight.names:
            value = np.asarray(weights[name])
            if name in self.buffers:
                loads[name] = value
                continue
            self.start[name] = np.array(value, copy=True)
            loads[name] = local[name] * mix + value * (1.0 - mix) if mix else value
        received = sum(int(np.asarray(weights[n]).nbytes) for n in flight.names)
        self.client.bytes_sent += flight.sent
        self.client.bytes_received += received
        seconds = time.perf_counter() - flight.started
        return Landed(flight.step, seconds, flight.sent, received)
