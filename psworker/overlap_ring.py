"""``overlap=True`` in mode allreduce, as DDP does it: backward's post-accumulate-grad hooks
fill the gradient buckets (a fixed plan, the same on every rank: the reverse of the
parameters' order, as backward makes their gradients), and each bucket's ring all-reduce
starts in the background as soon as it is full and every earlier bucket has started (so every
rank runs the collectives in the same order), while backward goes on.

``step()`` then runs the serial step, whose push waits for the buckets in flight, sends the
rest (a bucket holding an unused parameter's gradient is completed there, with zeros), and
applies the optimizer locally with the skip flag and the agreement check, exactly as without
overlap: each element is summed in the same order either way (``psworker.ring.reduction``),
so the results are the same bits. Arming and its fallbacks are ``GradWatch``'s, as for the
parameter-server overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from psworker.overlap_watch import GradWatch

__all__ = ["BucketOverlap", "BucketSteps"]


@runtime_checkable
class BucketSteps(Protocol):
    """A client whose step's gradients can leave bucket by bucket (``AllReduceClient``)."""

    def gradient_buckets(self) -> list[list[str]]: ...

    def reduce_in_turns(self) -> None: ...

    def start_bucket(self, index: int, grads: Mapping[str, np.ndarray]) -> None: ...

    def abandon_step(self, error: Exception) -> None: ...

    def sum_over_ranks(self, array: np.ndarray) -> np.ndarray: ...


class BucketOverlap:
    """Starts each gradient bucket's all-reduce from backward; ``step()`` checks, then the
    serial step finishes the buckets and applies.

    All of its state is touched by the training thread only (CPU autograd runs hooks in the
    thread that called ``backward()``); the client's own thread runs the collectives.
    """

    def __init__(
        self,
        client: BucketSteps,
        params: Mapping[str, torch.nn.Parameter],
        to_host: Callable[[dict[str, torch.Tensor]], dict[str, np.ndarray]],
    ) -> None:
        self._client = client
        self._params = dict(params)
        self._to_host = to_host
        self._watch = GradWatch()
        self._buckets = client.gradient_buckets()
        self._bucket_of = {n: i for i, names in enumerate(self._buckets) for n in names}
        self._watch.hook(self._params, self._reached)
        client.reduce_in_turns()  # from the first step: every rank runs the same collectives
        # Per bucket: the trainable names backward has not reached (None: the step's first
        # hook reads which parameters require grad now).
        self._waiting: list[set[str]] | None = None
        self._next = 0  # the next bucket to start
        self._sent: list[str] = []  # the gradients started buckets carried
        self._error: Exception | None = None
        self._end()

    @property
    def armed(self) -> bool:
        return self._watch.armed

    def _reached(self, name: str, grad: torch.Tensor) -> None:
        """An armed step's gradient from backward (``GradWatch.hook``): starts every bucket
        now ready."""
        if self._error is not None:
            return
        try:
            if self._waiting is None:
                self._waiting = [GradWatch.trainable(self._params, b) for b in self._buckets]
            index = self._bucket_of.get(name)
            if index is not None:
                self._waiting[index].discard(name)
            while self._next < len(self._buckets) and not self._waiting[self._next]:
                self._start(self._next)
                self._next += 1
        except Exception as exc:  # raised by step(): an error inside backward() loses context
            self._error = exc

    def _start(self, index: int) -> None:
        """Sends bucket ``index``: its gradients that are not None, as numpy views."""
        grads = {
            n: g
            for n in self._buckets[index]
            if (p := self._params.get(n)) is not None and (g := p.grad) is not None
        }
        with torch.no_grad():
            arrays = self._to_host(grads)
        self._client.start_bucket(index, arrays)
        self._sent.extend(grads)

    def step(self, grad_scaler: Any = None) -> bool:
        """Checks an armed step: the buckets backward started carried the gradients step()
        has now (False: the serial step follows and finishes them).

        Raises:
            ValueError: a GradScaler, or gradients changed after their bucket left
                (clip_grad_norm_, unscale_, a second backward()); the ring is then given up
                with the error, so the other ranks fail with it too.
            PSError: starting a bucket failed.
        """
        try:
            if self._error is not None:
                raise self._error
            self._watch.refuse_scaler(grad_scaler)
            grads = {n: self._params[n].grad for n in self._sent}
            self._watch.check_unchanged(self._sent, grads, "the ring sums")
        except Exception as exc:
            if self._next:
                self._client.abandon_step(exc)
            raise
        finally:
            self._end()
        return False

    def discard(self) -> None:
        """``zero_grad()``: raises where a backward's hooks already began this step; the ring
        is given up with the error where buckets left, so the other ranks fail with it too.

        Raises:
            ValueError: the step began (``GradWatch.dropped``).
        """
        if self._waiting is None:
            return
        error = GradWatch.dropped()
        if self._next:
            self._client.abandon_step(error)
        self._end()
        raise error

    def observe(self, grads: Mapping[str, torch.Tensor], grad_scaler: Any, closure: Any) -> None:
        """After a serial step: arms overlap, or keeps the serial step (``GradWatch``)."""
        self._watch.observe(grads, grad_scaler, closure)
        self._end()

    def wait(self) -> None:
        """Nothing lands after ``step()``: the serial step applied every bucket."""

    def hold(self, held: bool) -> None:
        """While held, a serial step that would arm overlap leaves it unarmed (the trial of
        ``overlap="auto"``, psworker/overlap_trial.py); every rank holds the same steps."""
        self._watch.held = held

    def disarm(self) -> None:
        """Every later step is serial (nothing is in flight between steps)."""
        self._watch.disarm()

    def agree(self, times: np.ndarray) -> np.ndarray:
        """Every rank's times summed over the ring: each rank makes the same choice.

        Raises:
            WaitTimeoutError, UnavailableError: a peer is silent or gone.
        """
        return self._client.sum_over_ranks(times)

    def close(self) -> None:
        """Nothing of its own to stop (the client's thread stops with the client)."""

    def _end(self) -> None:
        self._watch.reset()
        self._waiting = None
        self._next = 0
        self._sent = []
        self._error = None
