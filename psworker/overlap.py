"""Communication overlapped with computation for ``DistributedOptimizer(..., overlap=True)``:
each shard's push-pull starts from backward's post-accumulate-grad hooks as soon as every
gradient that shard holds is ready, and the next forward waits, module by module (forward
pre-hooks), only for the shards holding that module's weights.

A shard's round takes one push per worker per step (sync), so the unit of overlap is the shard:
its push leaves while backward still runs through the layers before it, and its reply (the
weights of step t+1) is decoded straight into the parameters' memory when it arrives.

The serial step stays the reference: overlap arms itself only after one serial step showed that
nothing touches the gradients between ``backward()`` and ``step()`` (no ``clip_grad_norm_``, no
GradScaler, no second ``backward()`` accumulating into them, no closure); a script that does
keeps the serial step, with a warning saying why. A gradient changed after its shard's push left
(a clip only on some steps) is an error, never a silently different step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from pscore.optspec import StepOptions
from pswire.errors import ConfigError
from psworker.overlap_ring import BucketOverlap, BucketSteps
from psworker.overlap_watch import GradWatch, Overlap

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
    receivers: Mapping[str, np.ndarray],
    to_host: Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]],
    changed_values: Callable[[], dict[int, dict[str, float]]],
) -> Overlap:
    """The overlap for ``client`` (checked by ``overlap_unsupported``): shard by shard
    (``ShardOverlap``) or bucket by bucket over the ring (``BucketOverlap``)."""
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
        receivers: Mapping[str, np.ndarray],
        to_host: Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]],
        changed_values: Callable[[], dict[int, dict[str, float]]],
    ) -> None:
        self._client = client
        self._params = dict(params)
        self._buffers = dict(buffers)
        self._out = dict(receivers)
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
        self._trainable = {n for n, p in self._params.items() if p.requires_grad}
        self._pool = ThreadPoolExecutor(max_workers=shards, thread_name_prefix="ps-overlap")
        self._deadline = float(client.timeout) + _LANDING_SLACK_S
        self._watch = GradWatch()  # this step's gradients as backward left them; arming
        self._step: int | None = None  # the step being pushed (None: none started)
        self._values: dict[int, dict[str, float]] = {}
        self._waiting: list[set[str]] = []  # per shard: trainable names backward has not reached
        self._sent: dict[int, tuple[Future[bool], list[str]]] = {}
        self._error: Exception | None = None
        # The previous step's shards still landing: shard -> (its call, the names it stepped).
        self._landing: dict[int, tuple[Future[bool], list[str]]] = {}
        self._skipped = False
        for name, p in self._params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(partial(self._reached, name))
        ids = {id(t): n for n, t in {**self._params, **self._buffers}.items()}
        for module in model.modules():
            own = [*module._parameters.values(), *module._buffers.values()]
            needs = {s for t in own if id(t) in ids for s in self._shards_of[ids[id(t)]]}
            if needs:
                module.register_forward_pre_hook(partial(self._before_forward, frozenset(needs)))
        # model.state_dict() (a checkpoint) reads the weights: they must have landed.
        model.register_state_dict_pre_hook(lambda *_: self.wait())

    # -- hooks -------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        return self._watch.armed

    def _reached(self, name: str, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: notes the gradient; sends every shard it completes."""
        if not self._watch.reached(name, param.grad) or self._error is not None:
            return
        try:
            if self._step is None:
                self._begin()
            for shard in self._shards_of[name]:
                waiting = self._waiting[shard]
                waiting.discard(name)
                if not waiting and shard not in self._sent:
                    self._send(shard)
        except Exception as exc:  # raised by step(): an error inside backward() loses context
            self._error = exc

    def _before_forward(self, shards: frozenset[int], module: Any, args: Any) -> None:
        """Forward pre-hook: waits only for the shards holding this module's tensors."""
        if self._landing:
            for shard in shards:
                if shard in self._landing:
                    self._land(shard)

    # -- the step ----------------------------------------------------------------------------

    def step(self, grad_scaler: Any = None) -> bool:
        """Ends an overlapped step: checks nothing changed the gradients already sent, sends
        the shards backward did not complete (unused parameters, frozen ones, buffers only),
        and returns (True: the step is done) without waiting: the next forward waits per
        module.

        Raises:
            ValueError: a GradScaler, or gradients or hyper-parameters changed after their
                push left (clip_grad_norm_, unscale_, a second backward()).
            PSError: a shard's call failed.
        """
        try:
            if self._error is not None:
                raise self._error
            self._watch.refuse_scaler(grad_scaler)
            if self._step is None:
                self._begin()
            sent = [n for _, names in self._sent.values() for n in names]
            grads = {n: self._params[n].grad for n in sent}
            self._watch.check_unchanged(sent, grads, "the shards hold")
            if self._changed_values() != self._values:
                raise ConfigError(
                    "with overlap=True a parameter group's hyper-parameters changed between "
                    "backward() and step(), after some shards' pushes left with the old ones: "
                    "change them before backward() (a scheduler's step() after opt.step() "
                    "does), or construct DistributedOptimizer(..., overlap=False)"
                )
            for shard in range(len(self._names_on)):
                if shard not in self._sent:
                    self._send(shard)
        finally:
            self._landing.update(self._sent)  # landed (or their errors raised) by wait()
            self._end()
        return True

    def wait(self) -> None:
        """Lands every shard's reply still in flight (each call has the client's deadline).

        Raises:
            PSError: a shard's call failed.
        """
        for shard in list(self._landing):
            self._land(shard)

    def observe(self, grads: Mapping[str, torch.Tensor], grad_scaler: Any, closure: Any) -> None:
        """After a serial step: arms overlap, or keeps the serial step (``GradWatch``)."""
        self._watch.observe(grads, grad_scaler, closure)
        self._end()

    def close(self) -> None:
        """Stops the pool (calls in flight finish on their own deadline)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------

    def _begin(self) -> None:
        """The first gradient of a step: the previous step must have landed everywhere (one
        shard's steps go in order), then this step's number and hyper-parameters are fixed."""
        self.wait()
        self._values = self._changed_values()
        self._step = self._client.step
        self._waiting = [{n for n in names if n in self._trainable} for names in self._names_on]

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
        future = self._pool.submit(self._call, shard, arrays, self._step, options)
        self._sent[shard] = (future, list(grads))

    def _call(
        self, shard: int, arrays: dict[str, np.ndarray], step: int, options: StepOptions
    ) -> bool:
        return self._client.start_shard_step(shard, arrays, step, self._out, options)()

    def _land(self, shard: int) -> None:
        """Waits for ``shard``'s reply (already decoded into the parameters) and marks its
        stepped parameters changed in place for autograd, as ``torch.optim`` does.

        Raises:
            PSError: the shard's call failed.
        """
        future, stepped = self._landing.pop(shard)
        self._skipped |= future.result(timeout=self._deadline)
        with torch.no_grad():
            for name in stepped:
                torch.autograd.graph.increment_version(self._params[name])
        if not self._landing:
            self._client.last_skipped = self._skipped
            self._skipped = False

    def _end(self) -> None:
        self._watch.reset()
        self._step = None
        self._sent = {}
        self._error = None
