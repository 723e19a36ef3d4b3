"""Communication overlapped with computation for ``DistributedOptimizer(..., overlap=True)``:
each shard's push-pull starts from backward's post-accumulate-grad hooks, and the next forward
waits, module by module (forward pre-hooks, psworker/landing.py), only for the weights that
module needs, decoded straight into the parameters' memory as each shard's reply arrives.

A shard's round takes one push per worker per step (sync). Where a shard's step goes on its
Flight data port, its push streams from the step's first gradient (psworker/push_stream.py):
the manifest in the previous step's order, each gradient written as backward produces it, the
last held until ``step()`` has checked them, so the push leaves during backward even though the
placement interleaves layers over the shards, and its reply lands tensor by tensor under the
next forward. A step small enough for grpcio (``grpc_below_bytes``) goes whole once every
gradient its shard holds is ready, and lands whole.

The serial step stays the reference: overlap arms itself only after one serial step showed that
nothing touches the gradients between ``backward()`` and ``step()`` (no ``clip_grad_norm_``, no
GradScaler, no second ``backward()`` accumulating into them, no closure); a script that does
keeps the serial step, with a warning saying why. A gradient changed after its shard's push left
(a clip only on some steps) is an error, never a silently different step; streamed pushes are
then cancelled, so no shard applies any of that step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from pscore.optspec import StepOptions
from pswire.errors import ConfigError
from psworker.landing import Landing
from psworker.overlap_ring import BucketOverlap, BucketSteps
from psworker.overlap_watch import GradWatch, Overlap
from psworker.push_stream import StepStreams

__all__ = ["ShardOverlap", "ShardSteps", "build_overlap", "overlap_unsupported"]

# A landing waits at most this much beyond the client's own deadline (which bounds every call).
_LANDING_SLACK_S = 60.0


@runtime_checkable
class ShardSteps(Protocol):
    """A client whose step starts shard by shard (``PSClient.start_shard_step``)."""

    shard_map: Any
    step: int
    last_skipped: bool
    timeout: float

    def start_shard_step(
        self,
        shard: int,
        grads: Mapping[str, np.ndarray],
        step: int,
        out: Mapping[str, np.ndarray],
        options: StepOptions | None = None,
    ) -> Callable[[], bool]:
        """Sends one shard its part of a step; the returned call waits for its reply."""
        ...

    def stream_step(
        self,
        step: int,
        order: Sequence[str],
        buffers: Sequence[str],
        out: Mapping[str, np.ndarray],
        options: StepOptions | None = None,
        placed: Callable[[str], None] | None = None,
    ) -> StepStreams:
        """Opens a step whose pushes stream from backward (``PSClient.stream_step``)."""
        ...

    def before_close(self, land: Callable[[], None]) -> None:
        """Has the client's ``close()`` call ``land`` first (``PSClient.before_close``)."""
        ...


def overlap_unsupported(
    client: Any, targets: Mapping[str, torch.Tensor], receivers: Mapping[str, np.ndarray]
) -> str | None:
    """Why ``overlap=True`` cannot run with this client and model (None: it can)."""
    if not isinstance(client, ShardSteps | BucketSteps):
        return (
            f"mode '{getattr(client, 'mode', '?')}' has no per-shard or per-bucket step (overlap "
            "runs in the parameter-server modes sync, async and ssp, and in allreduce)"
        )
    if getattr(client, "min_workers", 0) or getattr(client, "max_workers", 0):
        return "an elastic job's membership changes between steps"
    if any(t.is_cuda for t in targets.values()):
        return "the model is on a GPU (overlap runs on CPU models for now)"
    missing = sorted(set(targets) - set(receivers))
    if missing:
        return f"tensors {missing[:3]} cannot be decoded in place (dtype without a numpy view)"
    return None


def build_overlap(
    model: torch.nn.Module,
    client: ShardSteps | BucketSteps,
    params: Mapping[str, torch.nn.Parameter],
    buffers: Mapping[str, torch.Tensor],
    receivers: Callable[[], Mapping[str, np.ndarray]],
    to_host: Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]],
    changed_values: Callable[[], dict[int, dict[str, float]]],
) -> Overlap:
    """The overlap for ``client`` (checked by ``overlap_unsupported``): shard by shard
    (``ShardOverlap``) or bucket by bucket over the ring (``BucketOverlap``). ``receivers()``:
    where each tensor's weights are decoded now (its memory, which ``model.to(memory_format=
    ...)`` or ``p.data = ...`` may have moved since the last step)."""
    if isinstance(client, BucketSteps):
        return BucketOverlap(client, params, to_host)
    return ShardOverlap(model, client, params, buffers, receivers, to_host, changed_values)


class ShardOverlap:
    """Starts each shard's step from backward and lands its reply before the next forward.

    All of its state is touched by the training thread only (CPU autograd runs hooks in the
    thread that called ``backward()``); a pool thread per shard runs each shard's call.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        client: ShardSteps,
        params: Mapping[str, torch.nn.Parameter],
        buffers: Mapping[str, torch.Tensor],
        receivers: Callable[[], Mapping[str, np.ndarray]],
        to_host: Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]],
        changed_values: Callable[[], dict[int, dict[str, float]]],
    ) -> None:
        self._client = client
        self._params = dict(params)
        self._buffers = dict(buffers)
        self._receivers = receivers
        self._out = dict(receivers())  # read again as each step begins
        self._to_host = to_host
        self._changed_values = changed_values
        shard_map = client.shard_map
        shards = len(shard_map.keys_by_shard)
        self._names_on: list[list[str]] = [[] for _ in range(shards)]
        self._shards_of: dict[str, list[int]] = {}
        for var in shard_map.variables:
            on = sorted({p.shard for p in shard_map.pieces_of(var.name)})
            self._shards_of[var.name] = on
            for shard in on:
                self._names_on[shard].append(var.name)
        self._watch = GradWatch()  # this step's gradients as backward left them; arming
        self._watch.hook(self._params, self._reached)
        # A call (or stream) per shard, and a cancelled stream's thread winding down beside the
        # call that sends its step whole.
        self._pool = ThreadPoolExecutor(max_workers=2 * shards, thread_name_prefix="ps-overlap")
        self._deadline = float(client.timeout) + _LANDING_SLACK_S
        self._step: int | None = None  # the step being pushed (None: none started)
        self._values: dict[int, dict[str, float]] = {}
        self._waiting: list[set[str]] = []  # per shard: trainable names backward has not reached
        self._sent: dict[int, tuple[Future[bool | None], list[str]]] = {}
        self._error: Exception | None = None
        # The previous step's replies still landing, and the next forward's waits for them.
        self._landing = Landing(
            model,
            {**self._params, **self._buffers},
            shard_map,
            self._deadline,
            self._landed,
        )
        # Streamed pushes (shards on a data port): the gradients the last step pushed, in the
        # order backward produced them (this step's manifest); this step's streams, their
        # threads, and the gradients added to them from backward's hooks.
        self._order: list[str] | None = None
        self._streams: StepStreams | None = None
        self._running: dict[int, Future[bool | None]] = {}
        self._streamed: set[str] = set()
        self._carried: set[int] = set()  # the shards whose stream carries this step
        self.streamed = 0  # shard steps a stream carried (the others went whole)
        # step() returns before its reply: closing the client must not cut the last step off.
        client.before_close(self.wait)

    # -- hooks -------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        return self._watch.armed

    def _reached(self, name: str, grad: torch.Tensor) -> None:
        """An armed step's gradient from backward (``GradWatch.hook``): sends every shard it
        completes."""
        if self._error is not None:
            return
        try:
            if self._step is None:
                self._begin()
            on = self._shards_of[name]
            streams = self._streams
            if streams is not None and any(shard in streams.streams for shard in on):
                with torch.no_grad():
                    streams.add(name, self._to_host({name: grad})[name])
                self._streamed.add(name)
            for shard in on:
                if streams is not None and shard in streams.streams:
                    continue
                waiting = self._waiting[shard]
                waiting.discard(name)
                if not waiting and shard not in self._sent:
                    self._send(shard)
        except Exception as exc:  # raised by step(): an error inside backward() loses context
            self._error = exc

    # -- the step ----------------------------------------------------------------------------

    def step(self, grad_scaler: Any = None) -> bool:
        """Ends an overlapped step: checks nothing changed the gradients already sent, sends
        the shards backward did not complete (unused parameters, frozen ones, buffers only),
        and returns (True: the step is done) without waiting: the next forward waits per
        module.

        Raises:
            ValueError: a GradScaler, or gradients or hyper-parameters changed after their
                push left (clip_grad_norm_, unscale_, a second backward()), or gradients
                set after it left.
            PSError: a shard's call failed.
        """
        try:
            if self._error is not None:
                raise self._error
            self._watch.refuse_scaler(grad_scaler)
            if self._step is None:
                self._begin()
            sent = {n for _, names in self._sent.values() for n in names} | self._streamed
            grads = {n: self._params[n].grad for n in sent}
            self._watch.check_unchanged(sent, grads, "the shards hold")
            late = sorted(
                n
                for shard, (_, stepped) in self._sent.items()
                for n in self._names_on[shard]
                if n in self._params and self._params[n].grad is not None and n not in stepped
            )
            if late:
                raise ConfigError(
                    f"with overlap=True the gradients of {late[:4]} appeared after their "
                    "shard's push left from backward (set by hand on a parameter backward did "
                    "not reach?): the shards would step without them. Construct "
                    "DistributedOptimizer(..., overlap=False) for a script that sets gradients "
                    "itself"
                )
            if self._changed_values() != self._values:
                raise ConfigError(
                    "with overlap=True a parameter group's hyper-parameters changed between "
                    "backward() and step(), after some shards' pushes left with the old ones: "
                    "change them before backward() (a scheduler's step() after opt.step() "
                    "does), or construct DistributedOptimizer(..., overlap=False)"
                )
            if self._streams is not None:
                self._finish_streams(self._streams)
            for shard in range(len(self._names_on)):
                if shard not in self._sent:
                    self._send(shard)
        except BaseException:
            if self._streams is not None:
                self._streams.abort()  # no shard applies a streamed push of this step
            raise
        finally:
            self._order = self._pushed_order()
            for shard, (call, stepped) in self._sent.items():  # landed (or raised) by wait()
                self._landing.add(shard, call, stepped, keyed=shard in self._carried)
            self._landing.watch()
            self._end()
        return True

    def wait(self) -> None:
        """Lands every shard's reply still in flight (each call has the client's deadline).

        Raises:
            PSError: a shard's call failed.
        """
        self._landing.wait()

    def discard(self) -> None:
        """``zero_grad()``: raises where a backward's pushes already left this step (its
        streams are cancelled; a push that went whole may be applied).

        Raises:
            ValueError: the step began (``GradWatch.dropped``).
        """
        if self._step is None:
            return
        if self._streams is not None:
            self._streams.abort()  # no shard applies a streamed push of this step
        for shard, (call, stepped) in self._sent.items():  # landed (or raised) by wait()
            self._landing.add(shard, call, stepped, keyed=False)
        self._end()
        raise GradWatch.dropped()

    def observe(self, grads: Mapping[str, torch.Tensor], grad_scaler: Any, closure: Any) -> None:
        """After a serial step: arms overlap, or keeps the serial step (``GradWatch``); notes
        the order backward produced the gradients in (the first streamed step's manifest)."""
        if not (self._watch.off or self._watch.armed):
            self._order = self._pushed_order()
        self._watch.observe(grads, grad_scaler, closure)
        self._end()

    def hold(self, held: bool) -> None:
        """While held, a serial step that would arm overlap leaves it unarmed (the trial of
        ``overlap="auto"``, psworker/overlap_trial.py)."""
        self._watch.held = held

    def disarm(self) -> None:
        """Lands the last step's replies; every later step is serial.

        Raises:
            PSError: a shard's call failed.
        """
        try:
            self.wait()
        finally:
            self._watch.disarm()
            self._order = None

    @staticmethod
    def agree(times: np.ndarray) -> np.ndarray:
        """Each worker chooses for itself (``overlap="auto"``): its own times."""
        return times

    def close(self) -> None:
        """Cancels this step's streamed pushes and stops the pool (calls in flight finish on
        their own deadline)."""
        if self._streams is not None:
            self._streams.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------

    def _begin(self) -> None:
        """The first gradient of a step: the previous step must have landed everywhere (one
        shard's steps go in order), then this step's number and hyper-parameters are fixed."""
        self.wait()
        self._out = dict(self._receivers())
        self._values = self._changed_values()
        self._step = self._client.step
        self._waiting = [GradWatch.trainable(self._params, names) for names in self._names_on]
        if self._order is not None:  # the manifest: the last step's gradients, in its order
            options = StepOptions(self._values, False)
            streams = self._client.stream_step(
                self._step,
                self._order,
                list(self._buffers),
                self._out,
                options,
                self._landing.placed,
            )
            self._streams = streams
            for shard in streams.shards:
                self._running[shard] = self._pool.submit(streams.run, shard)

    def _finish_streams(self, streams: StepStreams) -> None:
        """``step()`` for the streamed shards: the push's tensors no hook added (buffers,
        gradients backward did not reach this step) added now, then each stream's last tensor
        let go; a stream whose tensors are not its manifest's is cancelled, and its shard's
        step goes whole (``_send``)."""
        late: dict[str, torch.Tensor] = {}
        for shard in streams.shards:
            for name in self._names_on[shard]:
                if name in streams.added:
                    continue
                if name in self._buffers:
                    late[name] = self._buffers[name]
                elif (g := self._params[name].grad) is not None:
                    late[name] = g
        with torch.no_grad():
            carried = streams.finish(self._to_host(late))
        self.streamed += len(carried)
        self._carried = carried
        for shard in sorted(carried):
            stepped = [
                n
                for n in self._names_on[shard]
                if n in self._params and self._params[n].grad is not None
            ]
            self._sent[shard] = (self._running.pop(shard), stepped)

    def _pushed_order(self) -> list[str]:
        """The gradients a step pushes now, those backward reached first, in its order."""
        pushed = [n for n, p in self._params.items() if p.grad is not None]
        held = set(pushed)
        reached = self._watch.order()
        first = set(reached)
        return [n for n in reached if n in held] + [n for n in pushed if n not in first]

    def _send(self, shard: int) -> None:
        """Starts ``shard``'s call in the pool: its gradients (those not None) and buffers."""
        names = self._names_on[shard]
        grads = {
            n: g for n in names if n in self._params and (g := self._params[n].grad) is not None
        }
        buffers = {n: self._buffers[n] for n in names if n in self._buffers}
        with torch.no_grad():
            arrays = self._to_host({**grads, **buffers})
        assert self._step is not None
        options = StepOptions(self._values, False)
        future: Future[bool | None] = self._pool.submit(
            self._call, shard, arrays, self._step, options
        )
        self._sent[shard] = (future, list(grads))

    def _call(
        self, shard: int, arrays: dict[str, np.ndarray], step: int, options: StepOptions
    ) -> bool | None:
        return self._client.start_shard_step(shard, arrays, step, self._out, options)()

    def _landed(self, skipped: bool) -> None:
        """Every shard's reply of a step landed: whether the step was skipped (a worker's
        GradScaler), as the serial step tells the client."""
        self._client.last_skipped = skipped

    def _end(self) -> None:
        self._watch.reset()
        self._step = None
        self._sent = {}
        self._error = None
        self._streams = None
        self._running = {}
        self._streamed = set()
        self._carried = set()
