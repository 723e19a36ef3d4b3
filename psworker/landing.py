"""The weights a step's replies bring, landing before the next forward uses them
(``overlap=True``): each module waits, in a forward pre-hook, only for its own tensors.

A reply is decoded straight into the parameters' memory on a pool thread. Where a shard's
step streamed (psworker/push_stream.py), its reply tells each tensor as it lands, so a
module waits only for its own tensors while the rest of the reply still arrives: the pull
runs under the next forward. While such a reply is landing, a torch function mode watches
every op of the model's forward and waits for any tensor it uses that has not landed, so a
parameter read outside its own module (a weight used functionally by another) is never read
half-written. Elsewhere (a step sent whole) a module waits for its shards' whole replies.
Between ``step()`` and the next forward the same mode watches the script's own ops (an EMA's
``update_parameters``, a logged norm, ``p.detach()``): a tensor still landing is waited for,
never read stale or half-written.

Each parameter a step changed is marked changed in place for autograd (its version bumped, as
``torch.optim`` does) once, when it lands and before any op reads it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pswire.errors import WaitTimeoutError
from psworker.placement import ShardMap

__all__ = ["Landing", "ModelHook"]

# Tensor attributes and methods that read no element of a tensor (``p.data`` and views such as
# ``p.T`` do: not here). A weight still landing is not waited for by these: ``step()`` and
# ``zero_grad()`` read and set ``.grad`` while the replies land.
_METADATA = frozenset(
    {
        "grad",
        "requires_grad",
        "requires_grad_",
        "retain_grad",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "is_leaf",
        "grad_fn",
        "_version",
        "shape",
        "size",
        "dim",
        "ndim",
        "numel",
        "nbytes",
        "itemsize",
        "element_size",
        "dtype",
        "device",
        "layout",
        "is_cuda",
        "is_sparse",
        "is_meta",
        "is_floating_point",
        "is_complex",
        "stride",
        "is_contiguous",
        "storage_offset",
        "data_ptr",
    }
)


class Landing:
    """The replies still landing, shard by shard, and the model's waits for them.

    ``add``, ``wait`` and the hooks run on the training thread; ``placed`` comes from the
    threads decoding the replies.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tensors: Mapping[str, torch.Tensor],
        shard_map: ShardMap,
        deadline: float,
        landed: Callable[[bool], None],
    ) -> None:
        """``tensors``: the parameters and buffers replies land in, by variable name;
        ``deadline``: the longest wait for a reply (seconds); ``landed(skipped)``: told once
        every shard's reply of a step has landed, whether any said the step was skipped."""
        self._tensors = dict(tensors)
        self._deadline = deadline
        self._landed = landed
        self._pieces: dict[str, list[tuple[int, str]]] = {
            name: [(p.shard, p.key) for p in shard_map.pieces_of(name)] for name in self._tensors
        }
        self._names_on: list[list[str]] = [[] for _ in range(shard_map.num_shards)]
        for name, pieces in self._pieces.items():
            for shard in sorted({s for s, _ in pieces}):
                self._names_on[shard].append(name)
        # Shard -> (its call, the parameters its step changed): the replies still landing.
        self._calls: dict[int, tuple[Future[bool | None], list[str]]] = {}
        self._keyed: set[int] = set()  # those whose reply tells each tensor as it lands
        self._cond = threading.Condition()
        self._arrived: set[str] = set()  # piece keys landed (keyed replies), under _cond
        self._to_bump: set[str] = set()  # changed parameters whose version is not bumped yet
        self._unlanded: dict[int, str] = {}  # id(tensor) -> name, on a shard still landing
        self._skipped = False
        self._mode: _LandingMode | None = None  # on the torch function mode stack
        self._owner = 0  # the thread whose stack holds ``_mode``
        self._depth = 0  # nested calls of the model's forward
        hook = partial(ModelHook, copied=self.copying, pickled=self.wait)
        # First of the model's hooks: a failing hook after it still runs ``_leave``.
        model.register_forward_pre_hook(hook(self._enter))
        model.register_forward_hook(hook(self._leave), always_call=True)
        ids = {id(t): n for n, t in self._tensors.items()}
        for module in model.modules():
            own = [*module._parameters.values(), *module._buffers.values()]
            names = tuple(ids[id(t)] for t in own if t is not None and id(t) in ids)
            if names:
                module.register_forward_pre_hook(hook(partial(self._before_forward, names)))
        # model.state_dict() (a checkpoint) reads the weights: they must have landed.
        model.register_state_dict_pre_hook(hook(lambda *_: self.wait()))

    @property
    def pending(self) -> bool:
        """Whether some reply has not landed yet."""
        return bool(self._calls)

    def add(self, shard: int, call: Future[bool | None], stepped: list[str], keyed: bool) -> None:
        """``shard``'s reply will land when ``call`` returns (whether the step was skipped);
        ``stepped``: the parameters it changes; ``keyed``: its pieces are ``placed`` as they
        land."""
        self._calls[shard] = (call, stepped)
        self._to_bump.update(stepped)
        for name in self._names_on[shard]:
            self._unlanded[id(self._tensors[name])] = name
        if keyed:
            self._keyed.add(shard)
            call.add_done_callback(self._wake)

    def placed(self, key: str) -> None:
        """A piece of a keyed reply has landed (called from the thread decoding it)."""
        with self._cond:
            self._arrived.add(key)
            self._cond.notify_all()

    def wait(self) -> None:
        """Lands every reply still in flight.

        Raises:
            PSError: a shard's call failed.
        """
        for shard in list(self._calls):
            self._land(shard)
        self._unwatch()

    def watch(self) -> None:
        """``step()`` returned with replies still landing: until the next forward (or
        ``wait``), every torch op of this thread that reads a tensor not landed yet waits for
        it first (``used``)."""
        if self._calls and self._mode is None:
            self._mode = _LandingMode(self)
            self._mode.__enter__()
            self._owner = threading.get_ident()

    def copying(self, memo: Mapping[int, Any]) -> None:
        """A deep copy of the model is being made (``memo``: what it copied so far): lands
        every reply, and gives the tensors it copied before reaching a hook of ours (a
        module's own parameters come before its hooks) the landed values.

        Raises:
            PSError: a shard's call failed.
        """
        self.wait()
        with torch.no_grad():
            for tensor in self._tensors.values():
                copied = memo.get(id(tensor))
                if isinstance(copied, torch.Tensor) and copied is not tensor:
                    copied.copy_(tensor)

    def land(self, names: Iterable[str]) -> None:
        """Waits until the tensors ``names`` have landed (only their own pieces where the
        reply is keyed, else their shards' whole replies), and marks them changed.

        Raises:
            PSError: a shard's call failed.
            WaitTimeoutError: a reply did not come within the deadline.
        """
        names = list(names)
        for name in names:
            for shard, key in self._pieces[name]:
                call = self._calls.get(shard)
                if call is None:
                    continue
                if shard in self._keyed and self._wait_piece(call[0], key):
                    continue
                self._land(shard)
        self._bump(names)
        for name in names:
            self._unlanded.pop(id(self._tensors[name]), None)

    # -- hooks -------------------------------------------------------------------------------

    def _before_forward(self, names: tuple[str, ...], module: Any, args: Any) -> None:
        """Forward pre-hook: this module's own tensors must have landed."""
        if self._calls:
            self.land(names)

    def _enter(self, module: Any, args: Any) -> None:
        """The model's forward begins: while a keyed reply lands, every op is watched."""
        self._depth += 1
        if self._depth == 1 and not self._keyed:
            self._unwatch()  # each module's pre-hook waits for its own shards' replies
        if self._depth == 1 and self._keyed:
            self.watch()

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        if self._depth == 0:
            return  # a hook before ``_enter`` failed (a global one)
        self._depth -= 1
        if self._depth == 0:
            self._unwatch()

    def used(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
        """``func`` is about to read ``args``: those that have not landed land first, unless
        it reads no element of them (``_METADATA``)."""
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a Tensor attribute: named by its descriptor
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in _METADATA:
            return
        unlanded = self._unlanded
        found = []
        for value in (*args, *(kwargs or {}).values()):
            if isinstance(value, torch.Tensor):
                if id(value) in unlanded:
                    found.append(unlanded[id(value)])
            elif isinstance(value, list | tuple):
                found += [unlanded[id(v)] for v in value if id(v) in unlanded]
        if found:
            self.land(found)

    # -- internals ---------------------------------------------------------------------------

    def _wait_piece(self, call: Future[bool | None], key: str) -> bool:
        """Whether piece ``key`` landed while its call still runs (False: the call ended, and
        ``_land`` takes its result or error).

        Raises:
            WaitTimeoutError: neither within the deadline.
        """
        deadline = time.monotonic() + self._deadline
        with self._cond:
            while key not in self._arrived and not call.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"'{key}' of the last step's reply did not land within "
                        f"{self._deadline:.0f}s"
                    )
                self._cond.wait(left)
            return not call.done()

    def _unwatch(self) -> None:
        """Takes the mode off this thread's stack where it is on top (a mode the script
        entered after it stays above it until the script leaves it: ours waits); forgets it
        where it is gone (a script's exit popped it in place of its own)."""
        mode = self._mode
        if mode is None or threading.get_ident() != self._owner:
            return
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is mode:
            self._mode = None
            mode.__exit__(None, None, None)
        elif all(torch._C._get_function_stack_at(i) is not mode for i in range(depth)):
            self._mode = None

    def _wake(self, _: Future[bool | None]) -> None:
        with self._cond:
            self._cond.notify_all()

    def _land(self, shard: int) -> None:
        """Waits for ``shard``'s whole reply (already decoded into the tensors).

        Raises:
            PSError: the shard's call failed.
        """
        call, stepped = self._calls.pop(shard)
        self._keyed.discard(shard)
        try:
            self._skipped |= bool(call.result(timeout=self._deadline))
        finally:
            self._bump(stepped)
            if not self._calls:
                self._done()

    def _bump(self, names: Iterable[str]) -> None:
        """Marks the changed parameters among ``names`` changed in place, once each."""
        with torch.no_grad():
            for name in names:
                if name in self._to_bump:
                    self._to_bump.discard(name)
                    torch.autograd.graph.increment_version(self._tensors[name])

    def _done(self) -> None:
        """Every reply of the step has landed."""
        with self._cond:
            self._arrived.clear()
        self._keyed.clear()
        self._unlanded.clear()
        self._to_bump.clear()
        skipped, self._skipped = self._skipped, False
        self._landed(skipped)


def _inert(*_: Any) -> None:
    """What a copy of the model holds in place of a landing hook: nothing lands in a copy."""


def _inert_hook() -> Callable[..., None]:
    return _inert


class ModelHook:
    """A hook of the job's on the model, which copies of the model (``copy.deepcopy``, an
    EMA's ``AveragedModel``, a target network, ``torch.save(model)``) do not carry: a copy
    gets ``_inert`` instead. ``copied(memo)`` runs first when a deep copy is made,
    ``pickled()`` when the model is pickled (the landing makes copies from landed weights).

    A compiled model (``torch.compile``) runs it as it is, never traced: a trace would keep
    what it found when compiled (nothing landing) and read weights still landing."""

    __slots__ = ("_call", "_copied", "_pickled")

    def __init__(
        self,
        call: Callable[..., None],
        copied: Callable[[Mapping[int, Any]], None] | None = None,
        pickled: Callable[[], None] | None = None,
    ) -> None:
        self._call = call
        self._copied = copied
        self._pickled = pickled

    @torch.compiler.disable
    def __call__(self, *args: Any) -> None:
        self._call(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        if self._copied is not None:
            self._copied(memo)
        return _inert

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        if self._pickled is not None:
            self._pickled()  # torch.save writes the tensors' bytes after the pickle
        return (_inert_hook, ())


class _LandingMode(TorchFunctionMode):
    """Every torch op of the model's forward while a keyed reply lands, and of the script
    between ``step()`` and that forward: its tensors that have not landed yet land first
    (``Landing.used``)."""

    def __init__(self, landing: Landing) -> None:
        super().__init__()
        self._landing = landing

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if self._landing._unlanded:
            self._landing.used(func, args, kwargs)
        return func(*args, **(kwargs or {}))
