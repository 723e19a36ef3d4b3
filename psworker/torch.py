"""PyTorch integration: ``DistributedOptimizer``, a ``torch.optim.Optimizer`` that trains a
module through any client mode, wrapping the user's own torch optimizer."""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, NoReturn

import numpy as np
import torch

from pscore.job import TRAINABLE_DTYPES
from pscore.optim import Optimizer
from pscore.optspec import StepOptions
from pscore.tables import RowSparse
from pswire.errors import ConfigError, ModelMismatchError
from psworker.api import Client, Elastic, Replica
from psworker.landing import ModelHook
from psworker.overlap import build_overlap, overlap_unsupported
from psworker.overlap_trial import OverlapTrial
from psworker.overlap_watch import Overlap
from psworker.reports import StepLog
from psworker.torch_optim import (
    changed_values,
    check_supported,
    group_spec,
    slots_from_torch,
    slots_to_torch,
    spec_class,
    state_digest,
    torch_optimizer_for,
)
from psworker.torch_staging import HostStaging
from psworker.torch_tables import Embedding, EmbeddingBag, _tables_of

__all__ = ["BUFFER_PREFIX", "DistributedOptimizer", "Embedding", "EmbeddingBag"]

BUFFER_PREFIX = "buffer:"
# The steps at which a write through p.data is looked for (_warn_overwritten): the first
# CONTENT_CHECKS, then every CONTENT_CHECK_EVERY-th; each costs one pass over the weights.
CONTENT_CHECKS = 3
CONTENT_CHECK_EVERY = 64
# A trainable dtype's bits as the integer of their width (pscore.job.TRAINABLE_DTYPES).
_INTS = {torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
log = logging.getLogger(__name__)
# Each client's model (its variables' names, shapes, dtypes), once a DistributedOptimizer
# initialised it: a second, other model over the same client is refused with the way to train
# both.
_CLAIMED: weakref.WeakKeyDictionary[Any, frozenset[tuple[str, tuple[int, ...], str]]] = (
    weakref.WeakKeyDictionary()
)
# GradScaler hands itself to an optimizer whose step takes ``grad_scaler`` (the contract for
# optimizers that handle scaling themselves), with this FutureWarning each time; we need the
# scaler to tell it about a step another worker skipped.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)


class DistributedOptimizer(torch.optim.Optimizer):
    """Trains ``model`` through ``client``: ``step()`` pushes gradients and loads fresh weights.

    ``optimizer`` is the script's own torch optimizer (``torch.optim.SGD``, ``Adam``,
    ``AdamW``, ``Adagrad``, ``RMSprop``, ``Adadelta``, ``Adamax``, ``NAdam`` or ``RAdam``,
    constructed on the model's parameters, any number of parameter groups), or a
    ``psworker.SGD``-style spec. The same math runs on the shards in
    parameter-server modes and in this process in ``local`` and ``allreduce``. This object is
    a ``torch.optim.Optimizer`` whose ``param_groups`` are the wrapped optimizer's: whatever a
    scheduler or the script sets there (``lr``, ``weight_decay``, ``momentum``, ``betas``...)
    travels with the next ``step()`` (only values that differ from the ones at construction).
    Options that only pick a torch kernel (``foreach``, ``fused``) are ignored; ``maximize``,
    ``capturable``, ``differentiable`` and other classes are refused before anything is sent.

    On construction it registers every parameter of the optimizer's groups (a parameter in
    no group is not trained, as in torch) with the client; worker 0's weights become every
    worker's starting point, and are loaded into the model, so replicas start identical.

    With ``torch.amp.GradScaler``, ``scaler.step(opt)`` hands the scaler to ``step()``, which
    unscales the gradients; a step whose gradients hold inf/NaN is skipped as torch skips it:
    in ``sync`` and ``allreduce`` a skip by any worker skips the step for all (and each
    worker's scaler backs off), in ``async``/``ssp`` only that worker's push is dropped.

    Gradients that are ``None`` (parameters unused this step) are not sent: the shards do not
    update those parameters from this worker (in ``sync`` the step's average counts them as
    zero from this worker). Buffers (e.g. BatchNorm running statistics) travel beside the
    gradients: after each step every worker holds the shards' copy, which in ``sync`` mode is
    the mean over workers and otherwise the latest pushed, so replicas stay consistent.
    As torch's optimizers, ``step()`` steps every parameter whose gradient is not None (it
    warns once about one no backward reached since the last step) and marks them changed in
    place for autograd. One model per client: two models with two optimizers (a GAN) are
    made together with ``for_models``.

    ``overlap=True`` overlaps communication with computation (CPU models). In the
    parameter-server modes each shard's push leaves from backward's hooks (on a shard's Flight
    data port it streams from the step's first gradient, each gradient written as backward
    produces it, the last held until ``step()`` has checked them; a step small enough for
    grpcio leaves once every gradient its shard holds is ready), ``step()`` returns without
    waiting, and the next forward waits module by module (forward pre-hooks) only for the
    weights that module needs, decoded into the parameters as each shard's reply arrives. In
    ``allreduce`` (as DDP) each gradient bucket's ring all-reduce starts from backward's hooks
    once it is full and every earlier bucket has started, and ``step()`` waits for the buckets
    in flight, then applies the step locally; every rank must pass the same ``overlap``. The
    math is the serial step's (bit-identical in ``sync`` and ``allreduce``).
    ``overlap="auto"`` overlaps only where it pays: in the parameter-server modes it times
    a few serial steps, then a few overlapped ones, and keeps overlap only if its steps were
    faster (logged at INFO by ``psworker.overlap_trial``; ``overlapping`` tells the choice).
    Over loopback or a fast link on a machine short of cores, overlap's threads can cost more
    than they hide. In ``allreduce`` the ranks choose together (their times summed over the
    ring); where overlap is not supported (``local``, a GPU model, tables), ``"auto"`` is the serial
    step (logged), where ``True`` raises.
    Overlap arms after one serial step showed that nothing touches the gradients between
    ``backward()`` and ``step()``; a script that clips (``clip_grad_norm_``), uses a GradScaler
    or a closure, or accumulates several ``backward()`` per step keeps the serial step, with a
    warning. Between ``step()`` and the next forward the weights may still be landing: the
    model's forward, ``state_dict()``, copies of it, and any torch op of the training thread
    that reads one (an EMA's update, ``p.detach()``) wait for it; another thread should call
    ``synchronize()`` first.

    ``writer``: a TensorBoard ``torch.utils.tensorboard.SummaryWriter`` (or anything with
    ``add_scalar``) that gets each step's time, bytes sent and received and this worker's
    staleness, and what the script passes to ``report()`` (e.g. the loss). With
    ``$PS_REPORT_DIR`` set, the same reach ``psctl dashboard`` (``psworker/reports.py``).

    Raises (constructor):
        ValueError: an unsupported optimizer class or option, a parameter that is not
            floating point or not the model's (nothing was sent).
        PSError: the shards reject the model (e.g. ModelMismatchError).
    """

    _step_supports_amp_scaling = True  # GradScaler.step hands itself to step() (see above)

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedOptimizer:
        # mode="diloco": local steps with an outer step on the shards (psworker/torch_diloco.py).
        client = args[1] if len(args) > 1 else kwargs.get("client")
        if cls is DistributedOptimizer and getattr(client, "mode", None) == "diloco":
            from psworker.torch_diloco import DiLoCoOptimizer

            return super().__new__(DiLoCoOptimizer)
        return super().__new__(cls)

    def __init__(
        self,
        model: torch.nn.Module,
        client: Client,
        optimizer: torch.optim.Optimizer | Optimizer,
        writer: Any = None,
        overlap: bool | str = False,
    ) -> None:
        if overlap not in (False, True, "auto"):
            raise ConfigError(f"overlap must be False, True or 'auto', got {overlap!r}")
        self._prepare(model, client, optimizer, prefix="", first_group=0, writer=writer)
        if overlap:  # checked before anything is sent
            targets = {**self._params, **self._buffers}
            why = overlap_unsupported(client, targets, self._staging.receivers(targets))
            if self._tables:
                why = "embedding tables push row-sparse gradients at step()"
            if why and overlap == "auto":  # the choice is ours: the serial step
                log.info("overlap='auto' keeps the serial step: overlap is not supported: %s", why)
                overlap = False
            elif why:
                raise ConfigError(f"overlap=True is not supported here: {why}")
        _init_together(client, [self])
        if overlap:
            targets = {**self._params, **self._buffers}
            self._overlap: Overlap | None = build_overlap(
                model,
                client,  # type: ignore[arg-type]  # checked by overlap_unsupported
                self._params,
                self._buffers,
                partial(self._staging.receivers, targets),
                self._staging.to_host,
                self._changed_values,
            )
            if overlap == "auto":
                self._trial: OverlapTrial | None = OverlapTrial(self._overlap)

    @classmethod
    def for_models(
        cls,
        client: Client,
        writer: Any = None,
        **models: tuple[torch.nn.Module, torch.optim.Optimizer | Optimizer],
    ) -> tuple[DistributedOptimizer, ...]:
        """One ``DistributedOptimizer`` per model, all training through one ``client``: the
        two models and two optimizers of a GAN (``D=(netD, optimizerD), G=(netG,
        optimizerG)``), an actor and a critic, a teacher and a student.

        The models form one job (one init, so worker 0's weights of every model start every
        worker), each model's variables under its keyword (``D/main.0.weight``), so the same
        parameter names in both nets do not clash. Each returned optimizer, in the keywords'
        order, steps only its own model, exactly as its torch optimizer would: its
        ``step()`` is one push of its own gradients (one step of the client's count: a GAN
        iteration that steps D then G takes two steps) and loads only its own model's weights.
        The optimizers may be of different classes; each has its own parameter groups and
        scheduler. ``writer``: as the constructor's, shared by the models' optimizers.

        Raises:
            ValueError: no models, a keyword with '/', a parameter in two models, an elastic
                client (not yet), or what the constructor raises (nothing was sent).
            PSError: as the constructor.
        """
        if not models:
            raise ConfigError("for_models needs at least one model: for_models(client, D=...)")
        if "overlap" in models:
            raise ConfigError(
                "for_models has no overlap: each model's step() is serial (pushes after "
                "backward); DistributedOptimizer(model, client, optimizer, overlap=...) "
                "overlaps one model"
            )
        if len(models) > 1 and isinstance(client, Elastic):
            raise ConfigError(
                "for_models with an elastic client is not supported yet: shard() splits each "
                "epoch by the client's step, one per batch, and each model's step is one push"
            )
        parts: list[DistributedOptimizer] = []
        first = 0
        owners: dict[int, str] = {}
        for name, pair in models.items():
            if "/" in name or not name:
                raise ConfigError(f"model name {name!r} must be non-empty, without '/'")
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ConfigError(
                    f"for_models({name}=...) takes a (model, optimizer) pair, got "
                    f"{type(pair).__name__}"
                )
            part = cls.__new__(cls)
            part._prepare(
                pair[0], client, pair[1], prefix=f"{name}/", first_group=first, writer=writer
            )
            for p in [*part._params.values(), *part._buffers.values()]:
                other = owners.setdefault(id(p), name)
                if other != name:
                    raise ConfigError(
                        f"models '{other}' and '{name}' share a tensor of shape "
                        f"{tuple(p.shape)}: each model's optimizer must own its parameters"
                    )
            first += len(part._base)
            parts.append(part)
        _init_together(client, parts)
        return tuple(parts)

    def _prepare(
        self,
        model: torch.nn.Module,
        client: Client,
        optimizer: torch.optim.Optimizer | Optimizer,
        prefix: str,
        first_group: int,
        writer: Any = None,
    ) -> None:
        """Checks the optimizer and collects what this model sends, under ``prefix``, its
        groups numbered from ``first_group`` (nothing sent yet); ``writer`` as the
        constructor's.

        Raises:
            ValueError: as the constructor.
        """
        self.model = model
        self.client = client
        self._log = StepLog(client, writer)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            warnings.warn(
                "the model is wrapped in DistributedDataParallel, which already averages the "
                "gradients over its process group before step() sends them to the job: each "
                "step now moves them twice (and async/ssp become lockstep). Drop the DDP "
                "wrapper and init_process_group; pass the model itself",
                UserWarning,
                stacklevel=3,
            )
        _warn_renormed(model, client.mode)
        if isinstance(optimizer, Optimizer):
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch_optimizer_for(optimizer, trainable)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim optimizer or a psworker spec, got "
                f"{type(optimizer).__name__}"
            )
        self._base = check_supported(optimizer)  # each group's values at construction
        self._cls = spec_class(optimizer)
        self._inner = optimizer
        self._prefix = prefix
        self._first_group = first_group
        tables = _tables_of(model, client)
        handles = {id(t.handle): name for name, t in tables.items()}
        names = {id(p): n for n, p in model.named_parameters()}
        self._params: dict[str, torch.nn.Parameter] = {}
        groups: dict[str, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in handles:
                    groups[handles[id(p)]] = first_group + index
                    continue
                name = names.get(id(p))
                if name is None:
                    raise ConfigError(
                        f"parameter group {index} of {type(optimizer).__name__} holds a tensor "
                        f"of shape {tuple(p.shape)} that is not a parameter of the model"
                    )
                _check_tensor("parameter", name, p)
                self._params[prefix + name] = p
                groups[prefix + name] = first_group + index
        self._groups = groups
        self._buffers = {}
        for name, b in model.named_buffers():
            if b is not None:
                _check_tensor("buffer", name, b)
                self._buffers[BUFFER_PREFIX + prefix + name] = b
        self._buffer_homes = buffer_homes(model, self._buffers)
        if self._buffer_homes:
            model.register_forward_hook(ModelHook(self._adopt_after_forward))
        self._tables = tables
        everything = {**self._params, **self._buffers}
        on_gpu = any(t.is_cuda for t in everything.values())
        self._staging = HostStaging(everything, pin=on_gpu)
        self._stepped: set[int] = set()  # parameters a backward reached since the last step
        self._together = 1  # how many models train through the client (for_models)
        self._stale_warned = False
        # Each parameter's autograd version and memory address after the last step loaded the
        # job's weights into it (None: this model keeps its own values, or nothing is loaded
        # yet); see _warn_overwritten.
        self._versions: dict[str, tuple[int, int, tuple[int, ...]]] | None = None
        # With them, at the first steps and every CONTENT_CHECK_EVERY-th: each parameter's
        # bits summed (a write through p.data changes no version); see _fingerprints.
        self._sums: torch.Tensor | None = None
        self._loads = 0  # how many times the job's weights were loaded (and remembered)
        self._overwrite_warned = False
        self._overlap = None  # overlap=True: set by the constructor after init
        self._trial = None  # overlap="auto" in the parameter-server modes: set after init

    def _adopt_buffers(self) -> None:
        """Takes a buffer the model replaced since the last step (a forward's
        ``self.stat = 0.9 * self.stat + ...``, where BatchNorm writes in place) back into the
        tensor the job syncs, which its module then holds again: its values are pushed and
        the job's mean lands where the model reads it (was: the replacement never synced, and
        replicas drifted apart). One of another shape or dtype (a cache regrown for longer
        inputs) is left to the model, as its own."""
        for module, attr, name in self._buffer_homes:
            current, ours = module._buffers.get(attr), self._buffers[name]
            if current is None or current is ours:
                continue
            if (current.shape, current.dtype, current.device) == (
                ours.shape,
                ours.dtype,
                ours.device,
            ):
                with torch.no_grad():
                    ours.copy_(current)
                module._buffers[attr] = ours

    def _adopt_after_forward(self, module: Any, args: Any, output: Any) -> None:
        """The model's forward hook: ``_adopt_buffers`` before backward may push them
        (``overlap=True``)."""
        self._adopt_buffers()

    def _fixed(self) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
        """The model's parameters in no optimizer group (a frozen backbone), each with its bytes
        (a view of a contiguous CPU tensor's memory, else a copy): never trained nor sent, so
        every worker must hold the same."""
        held = {id(p) for p in self._params.values()}
        held |= {id(t.handle) for t in self._tables.values()}
        return {
            self._prefix + n: (
                p,
                p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy(),
            )
            for n, p in self.model.named_parameters()
            if id(p) not in held and not torch.nn.parameter.is_lazy(p)
        }

    def _finish(self) -> None:
        """Makes this object the torch optimizer over the wrapped one's groups (after init)."""
        optimizer = self._inner
        # A torch.optim.Optimizer over the same groups: isinstance checks, hooks, schedulers
        # and GradScaler see one; its state lives on the shards, not here.
        super().__init__([{"params": g["params"]} for g in optimizer.param_groups], {})
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        optimizer.state.clear()  # e.g. Adagrad's sums, made at construction; ours are remote
        self._watched: set[int] = set()  # parameters whose backward _reached hears of
        self._unwatched = list(self._params.values())  # frozen: no hook yet
        self._watch_new()

    def _watch_new(self) -> None:
        """Hooks the parameters that now require a gradient: a hook needs ``requires_grad``,
        and a frozen layer may be unfrozen later (gradual unfreezing)."""
        if not self._unwatched:
            return
        frozen = []
        for p in self._unwatched:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._reached)
                self._watched.add(id(p))
            else:
                frozen.append(p)
        self._unwatched = frozen

    def _reached(self, param: torch.Tensor) -> None:
        self._stepped.add(id(param))

    # -- the training step -------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients, as ``torch.optim.Optimizer.zero_grad`` does, and
        those of the rows embedding tables gathered since the last step (set to None whatever
        ``set_to_none``: a zeroed row would still step momentum and Adam's moments).

        Raises:
            ValueError: with ``overlap=True``, between a backward whose gradients already
                left and ``step()``: the step cannot be dropped.
        """
        overlap = getattr(self, "_overlap", None)  # DiLoCoOptimizer has none
        if overlap is not None:
            overlap.discard()
        for table in self._tables.values():
            table.zero_row_grads()
        if overlap is not None and not set_to_none:
            # Zeroing in place would change gradients a push may still be sending.
            overlap.wait()
        super().zero_grad(set_to_none)

    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None
    ) -> Any:
        """Pushes this worker's gradients (and buffers), then loads the weights the mode allows.

        ``sync`` waits until every worker's gradient for this step is applied; ``ssp`` waits
        only while a worker is more than ``staleness`` steps behind; ``async`` never waits.
        The push carries the groups' hyper-parameters that differ from construction.
        ``grad_scaler``: given by ``torch.amp.GradScaler.step``.

        Raises:
            ValueError: a group's hyper-parameter out of range, a refused option, or a change
                to what makes optimizer state (momentum on/off, amsgrad...): nothing sent.
            PSError: the push or pull failed (e.g. WaitTimeoutError naming the late workers).
        """
        started = time.perf_counter()
        pushed_step = self.client.step
        self._adopt_buffers()  # a forward of a submodule alone has no hook of ours
        self._warn_overwritten()
        overlapped = self._overlap is not None and self._overlap.armed
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._overlap is not None and self._overlap.armed and self._overlap.step(grad_scaler):
            # The step left from backward's hooks (the shards' pushes): nothing more to send.
            self._warn_stale({n: p.grad for n, p in self._params.items() if p.grad is not None})
            self._inner._opt_called = True  # type: ignore[attr-defined]  # for its schedulers
            if self._trial is not None:
                self._trial.ended(overlapped)
            return loss
        values = self._changed_values()
        # A table untouched this step is left out: it counts as zero, like a None grad; so is
        # one in no optimizer group, which this optimizer does not train (as torch's).
        rows = {}
        for name, table in self._tables.items():
            grad = table.take_grads()  # every table's: its forwards since the last step are done
            if grad is not None and name in self._groups:
                rows[name] = grad
        skip = grad_scaler is not None and _unscale(grad_scaler, self, rows)
        # Every gradient that is not None, as torch.optim steps it (even one no backward
        # reached since the last step: torch applies it again, and so do we, with a warning).
        grads = {} if skip else {n: p.grad for n, p in self._params.items() if p.grad is not None}
        self._warn_stale(grads)
        with torch.no_grad():
            outgoing = self._staging.to_host({**grads, **self._buffers})
            targets = {**self._params, **self._buffers}
            # One round trip per shard per step, decoded straight into the model (or its
            # pinned staging): no second copy.
            out = self._staging.receivers(targets)
            # Tables' prefetched ids (the next batch's): their rows come back with the weights.
            ahead = {n: i for n, t in self._tables.items() if (i := t.take_prefetch()) is not None}
            weights = self.client.push_pull(
                {**outgoing, **({} if skip else rows)},
                out=out,
                options=StepOptions(values, skip),
                rows=ahead or None,
            )
            for name, table in self._tables.items():
                table.prefetched(ahead.get(name), weights.pop(name, None))
            # Only this model's weights: another model's (for_models) stay as its own
            # optimizer left them, as with torch, where this step would not touch them.
            self._staging.to_device({n: w for n, w in weights.items() if n in targets}, targets)
            # torch.optim changes each stepped parameter in place, which autograd records: a
            # graph built before this step and used after it fails as it would with torch
            # (e.g. G's graph after a D step that also stepped G's stale gradient).
            for name in grads:
                torch.autograd.graph.increment_version(self._params[name])
        self._remember_versions()
        if self._log.active:
            sent = sum(int(a.nbytes) for a in outgoing.values())
            sent += 0 if skip else sum(int(g.nbytes) for g in rows.values())
            received = sum(int(a.nbytes) for a in weights.values())
            self._log.step(pushed_step, time.perf_counter() - started, sent, received)
        if grad_scaler is not None and self.client.last_skipped and not skip:
            _found_inf(grad_scaler, self)  # another worker skipped: back off as it does
        if self._trial is not None:
            self._trial.ended(overlapped)  # serial: may release the overlap to arm (observe)
        if self._overlap is not None:
            self._overlap.observe(grads, grad_scaler, closure)
        self._inner._opt_called = True  # type: ignore[attr-defined]  # for its schedulers
        return loss

    @property
    def overlapping(self) -> bool:
        """Whether ``step()`` overlaps communication now: armed (after the first serial step
        and, with ``overlap="auto"``, while it is faster; see the constructor)."""
        overlap = getattr(self, "_overlap", None)  # DiLoCoOptimizer has none
        return overlap is not None and overlap.armed

    def synchronize(self) -> None:
        """Waits until the last ``step()``'s weights are in the model (only ``overlap=True``
        leaves them landing after ``step()``; the next forward waits on its own).

        Raises:
            PSError: a shard's call failed.
        """
        if self._overlap is not None:
            self._overlap.wait()

    def report(self, **values: Any) -> None:
        """Records the script's own figures at this step, e.g. ``opt.report(loss=loss)``
        (numbers or 0-d tensors): to the ``writer`` given at construction, and to ``psctl
        dashboard`` when ``$PS_REPORT_DIR`` is set. Costs nothing when neither is.

        Raises:
            ValueError: a value that is not a number.
        """
        if self._log.active:
            self._log.report(values)

    def _changed_values(self) -> dict[int, dict[str, float]]:
        """Each group's hyper-parameters that differ from construction (checked).

        Raises:
            ValueError: as ``step``.
        """
        if len(self.param_groups) != len(self._base):
            raise ConfigError(
                f"the optimizer has {len(self.param_groups)} parameter groups; it had "
                f"{len(self._base)} when wrapped (add_param_group is not supported)"
            )
        kind = type(self._inner).__name__
        out = {}
        for index, (group, base) in enumerate(zip(self.param_groups, self._base, strict=True)):
            now = group_spec(self._cls, group, kind, index, self.defaults)
            if now.layout() != base.layout():
                raise ConfigError(
                    f"torch.optim.{kind} parameter group {index}: {changed_values(base, now)} "
                    "changes which optimizer state exists; that is fixed at construction"
                )
            changed = changed_values(base, now)
            if changed:
                out[self._first_group + index] = changed
        return out

    def _remember_versions(self) -> None:
        """Notes each parameter's autograd version once the job's weights are loaded into the
        model, where a step replaces the model's weights with them: the parameter-server
        modes, and any model on a GPU (not with overlap, whose pulls land during forward)."""
        held = isinstance(self.client, Replica) and not self._staging.pin
        if not held and self._overlap is None:
            self._versions = {n: _placed(p) for n, p in self._params.items()}
            self._loads += 1
            content = self._loads <= CONTENT_CHECKS or self._loads % CONTENT_CHECK_EVERY == 0
            self._sums = self._fingerprints() if content and not self._overwrite_warned else None

    def _fingerprints(self) -> torch.Tensor:
        """Each parameter's bits summed as integers (exact, in any order, on any device, NaNs
        included): a write through ``p.data`` (WGAN's ``p.data.clamp_``) changes them but no
        autograd version. One pass over the weights, on the steps _remember_versions picks:
        8 ms for 25M float32 weights on this 2-core machine, as long as a float sum."""
        with torch.no_grad():
            # Summed in their own width, wrapping (as fast as a float sum; to int64 it is six
            # times slower), then widened to stack the dtypes together.
            sums = [
                p.view(_INTS[p.dtype]).sum(dtype=_INTS[p.dtype]).long()
                for p in self._params.values()
            ]
            if not sums:
                return torch.zeros(0, dtype=torch.int64)
            return torch.stack([t.to(sums[0].device) for t in sums]).cpu()  # one sync

    def _warn_overwritten(self) -> None:
        """Warns (once) when the script changed parameters in place since the job's weights
        were last loaded into them (``model.load_state_dict`` after this optimizer was made,
        a write under ``torch.no_grad()``, a new tensor assigned to ``p.data`` as MoCo's
        momentum update does): this step replaces them with the job's weights, so the change
        would be lost without a word. An in-place write through ``.data`` (WGAN's weight
        clipping) changes no version: it is seen at the first steps and every
        ``CONTENT_CHECK_EVERY``-th, where the weights' contents are compared too."""
        versions = self._versions
        if versions is None or self._overwrite_warned or self._overlap is not None:
            return
        changed = [n for n, p in self._params.items() if _written(_placed(p), versions.get(n))]
        if not changed and self._sums is not None:
            differs = (self._fingerprints() != self._sums).tolist()
            changed = [n for n, d in zip(self._params, differs, strict=True) if d]
        if changed:
            self._overwrite_warned = True
            warnings.warn(
                f"step(): the script changed {len(changed)} parameters ({_few(changed)}) in "
                "place since the job's weights were loaded into the model (model.load_state_dict "
                "after the DistributedOptimizer was made? a write under torch.no_grad(), to "
                "p.data or through it, as weight clipping's p.data.clamp_?). "
                f"In {self.client.mode!r} mode{' with a GPU model' if self._staging.pin else ''} "
                "the job's weights live outside the model (on the shards, or in the client for "
                "a GPU model): this step loads them into it, and that change is lost. To change "
                "the job's weights, call opt.load_state_dict(...) after model.load_state_dict "
                "(every worker), or load the weights before making the DistributedOptimizer; a "
                "parameter the script updates itself each step (an EMA target network) belongs "
                "in no optimizer group; a rule applied to the weights after each step (clipping) "
                "works only where the model keeps its own values (mode='allreduce' or 'local' "
                "with a CPU model)",
                stacklevel=3,
            )

    def _warn_stale(self, grads: dict[str, torch.Tensor]) -> None:
        """Warns (once) when this step applies gradients no backward reached since the last
        step while it reached others: torch.optim applies them again too, which in a GAN
        script is D's old gradient applied on G's step (one optimizer over two models)."""
        reached, self._stepped = self._stepped, set()
        watched = set(self._watched) if self._unwatched else self._watched
        self._watch_new()  # those unfrozen since: judged from the next step on
        if self._stale_warned or not reached:
            return  # no hook fired: gradients set by hand, nothing to judge
        stale = [
            n
            for n in grads
            if id(self._params[n]) in watched and id(self._params[n]) not in reached
        ]
        if stale:
            self._stale_warned = True
            warnings.warn(
                f"step() applies the gradients of {len(stale)} parameters ({_few(stale)}) that no "
                "backward() reached since the last step(), as torch.optim does: they are "
                "applied again. With two models (a GAN's D and G) give each its own optimizer: "
                "DistributedOptimizer.for_models(client, D=(netD, optD), G=(netG, optG)), or "
                "zero their gradients",
                UserWarning,
                stacklevel=3,
            )

    # -- state_dict ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's format (``state`` and ``param_groups``), the optimizer slots fetched from the
        shards (or this process): ``load_state_dict`` of the plain torch optimizer of the same
        class accepts it. (Embedding tables' rows and slots are in the shards' checkpoints.)

        Raises:
            PSError: the shards did not answer.
        """
        self.synchronize()
        slots = self.client.optimizer_state()
        state = self._inner.state
        try:
            for name, p in self._params.items():
                found = slots_to_torch(self._cls, slots.get(name, {}), p)
                if found is not None:
                    state[p] = found
            return self._inner.state_dict()
        finally:
            state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict in torch's format: ours, or the plain torch optimizer's of the
        same class (a single-process checkpoint). The groups' hyper-parameters become the
        current ones; worker 0's slots, and its model's current weights, become the job's (the
        other workers check they loaded the same state, and wait for worker 0's). Call it on
        every worker, before training, after loading the model's own state_dict.

        Raises:
            ValueError: a state_dict of another class, group layout or size.
            ModelMismatchError: this worker loaded another state than worker 0.
            PSError: the shards refused the state (nothing changed there).
        """
        self.synchronize()
        if self._together > 1:
            raise ConfigError(
                "load_state_dict of one of several models (for_models) is not supported yet: "
                "it would restart the other models' optimizer state"
            )
        kind = type(self._inner).__name__
        saved = state_dict.get("param_groups", [])
        for index, (group, base) in enumerate(zip(saved, self._base, strict=False)):
            loaded = group_spec(self._cls, group, kind, index, self.defaults)
            if loaded.layout() != base.layout():
                raise ConfigError(
                    f"the state_dict's parameter group {index} is for {loaded}; this optimizer "
                    f"runs {base} (the state each keeps differs)"
                )
        self._inner.load_state_dict(state_dict)  # torch's checks; casts to the parameters
        self.param_groups = self._inner.param_groups
        try:
            slots = {
                name: slots_from_torch(self._inner.state[p], p)
                for name, p in self._params.items()
                if p in self._inner.state
            }
        finally:
            self._inner.state.clear()
        kind = type(self._inner).__name__
        groups = [
            group_spec(self._cls, g, kind, i, self.defaults)
            for i, g in enumerate(self.param_groups)
        ]
        everything = {**self._params, **self._buffers}
        with torch.no_grad():
            values = {
                n: np.array(a, copy=True) for n, a in self._staging.to_host(everything).items()
            }
            self.client.load_state(values, slots, state_digest(slots, groups))
            self._staging.to_device(self.client.pull(), everything)
        self._remember_versions()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from self._params.values()


def _warn_renormed(model: torch.nn.Module, mode: str) -> None:
    """Warns of each ``torch.nn.Embedding``/``EmbeddingBag`` with ``max_norm``: its forward
    rescales the rows it looks up in place, outside autograd and the optimizer, which only
    one process holding its own weights (``local`` mode, a CPU model) keeps as torch does."""
    on_cpu = all(not p.is_cuda for p in model.parameters())
    if mode == "local" and on_cpu:
        return
    for name, module in model.named_modules():
        embedding = isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag)
        if embedding and module.max_norm and module.weight.requires_grad:
            fate = (
                "each rank rescales the rows of its own batch, so the replicas drift apart "
                "(DDP has the same flaw)"
                if mode == "allreduce" and on_cpu
                else "the next step loads the job's weights over them, so the rescaling is lost"
            )
            warnings.warn(
                f"module '{name}' ({type(module).__name__}, max_norm={module.max_norm}) rescales "
                f"the rows each forward looks up in place, outside the optimizer: in {mode!r} "
                f"mode {fate}, and training differs from torch's. Drop max_norm, or bound the "
                "looked-up rows inside forward (e.g. torch.renorm of the embedding's output)",
                UserWarning,
                stacklevel=4,
            )


def _placed(p: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """A parameter's autograd version, memory address and strides (``_warn_overwritten``)."""
    return p._version, p.data_ptr(), p.stride()


def _written(now: tuple[int, int, tuple[int, ...]], then: Any) -> bool:
    """Whether the script wrote a parameter since ``then`` (its ``_placed`` at the last load):
    its version moved, or it has new memory of the same layout (``p.data = ...``, as MoCo's
    momentum update does). New memory of another layout is a move that keeps the values
    (``model.to(memory_format=torch.channels_last)``), which the next step loads into."""
    if then is None or now[0] != then[0]:
        return True
    return now[1] != then[1] and now[2] == then[2]


def _few(names: list[str]) -> str:
    """The first four names, for a warning that names what it found."""
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def raise_naming_fixed(exc: ModelMismatchError, fixed: Mapping[str, Any]) -> NoReturn:
    """Raises ``exc``, naming this worker's parameters in no optimizer group where their
    values are what the shards refused (the shards know only their digest)."""
    if fixed and "no optimizer group" in str(exc):
        raise ModelMismatchError(f"{exc}; this worker's are {_few(list(fixed))}") from exc
    raise exc


def _init_together(client: Client, parts: list[DistributedOptimizer]) -> None:
    """Agrees on one job holding every part's model with ``client``; worker 0's weights are
    loaded into every part's model.

    Raises:
        ValueError: two parts' tables share a name.
        PSError: the shards reject the job (e.g. ModelMismatchError).
    """
    names = frozenset(
        (n, tuple(t.shape), str(t.dtype))
        for part in parts
        for n, t in {**part._params, **part._buffers}.items()
    )
    claimed = _CLAIMED.get(client)
    if claimed is not None and claimed != names:
        raise ConfigError(
            "this client already trains another model (a DistributedOptimizer over "
            f"{sorted(n for n, _, _ in claimed)[:3]}...): for two models with two optimizers "
            "(a GAN), make "
            "both at once: DistributedOptimizer.for_models(client, D=(netD, optimizerD), "
            "G=(netG, optimizerG))"
        )
    if claimed is not None:
        raise ConfigError(
            "this client already has a DistributedOptimizer over this model. A new torch "
            "optimizer starts with fresh state, but the job's optimizer state (momentum, Adam's "
            "moments) lives with the job and would carry on, so a second one would not train as "
            "torch does. Keep the first one (change lr, weight decay... through its "
            "param_groups or a scheduler); to go on with another optimizer, export the model "
            "(psctl export) and start a new job from it"
        )
    tables: dict[str, Any] = {}
    for part in parts:
        clash = sorted(set(tables) & set(part._tables))
        if clash:
            raise ConfigError(f"two models hold embedding tables named {clash}")
        tables.update(part._tables)
    everything = {n: t for part in parts for n, t in {**part._params, **part._buffers}.items()}
    with torch.no_grad():
        fixed = {n: v for part in parts for n, v in part._fixed().items()}
        values: dict[str, np.ndarray] = {}
        for part in parts:
            own = {**part._params, **part._buffers}
            values.update(
                (n, np.array(a, copy=True)) for n, a in part._staging.to_host(own).items()
            )
        try:
            client.init(
                values,
                [spec for part in parts for spec in part._base],
                buffers=[n for part in parts for n in part._buffers],
                tables={name: m.table for name, m in tables.items()},
                groups={n: g for part in parts for n, g in part._groups.items()},
                fixed={n: a for n, (_, a) in fixed.items()},
            )
            weights = client.pull()
        except ModelMismatchError as exc:
            raise_naming_fixed(exc, fixed)
        for tensor, array in fixed.values():  # allreduce: rank 0's now
            tensor.copy_(torch.from_numpy(array).view(tensor.dtype).reshape(tensor.shape))
        for part in parts:
            own = {n: t for n, t in everything.items() if n in part._params or n in part._buffers}
            part._staging.to_device({n: weights[n] for n in own}, own)
            if isinstance(client, Replica) and not part._staging.pin:
                # allreduce and local: the step updates the CPU model in place, no copy back.
                held = part._staging.receivers(own)
                client.keep_in({n: a for n, a in held.items() if a.flags.c_contiguous})
    _CLAIMED[client] = names
    for part in parts:
        part._together = len(parts)
        part._finish()
        part._remember_versions()


def buffer_homes(
    model: torch.nn.Module, buffers: Mapping[str, torch.Tensor]
) -> list[tuple[torch.nn.Module, str, str]]:
    """Where each of ``buffers`` (the job's, by variable name) lives: (module, attribute,
    variable), so a forward that replaces one (``self.stat = 0.9 * self.stat + ...``, not in
    place) is adopted (``DistributedOptimizer._adopt_buffers``)."""
    ids = {id(b): n for n, b in buffers.items()}
    return [
        (module, attr, ids[id(b)])
        for module in model.modules()
        for attr, b in module._buffers.items()
        if b is not None and id(b) in ids
    ]


def _check_tensor(kind: str, name: str, tensor: torch.Tensor) -> None:
    """Refuses, before anything is sent, a tensor the job cannot hold: a lazy module's
    parameter before its first forward, a parameter of a dtype numpy has no form of.

    Raises:
        ConfigError: naming the tensor and what to do.
    """
    if torch.nn.parameter.is_lazy(tensor):
        raise ConfigError(
            f"{kind} '{name}' is not initialized yet (a lazy module such as nn.LazyLinear): "
            "run one forward pass on a batch before making the DistributedOptimizer, as "
            "torch's lazy modules advise before handing parameters to other code"
        )
    if kind == "parameter" and str(tensor.dtype).removeprefix("torch.") not in TRAINABLE_DTYPES:
        hint = (
            "; keep the model in float32 and compute in bfloat16 under "
            "torch.autocast(device, dtype=torch.bfloat16)"
            if tensor.dtype == torch.bfloat16
            else ""
        )
        raise ConfigError(
            f"parameter '{name}' has dtype {tensor.dtype}; a job's parameters are one of "
            f"{list(TRAINABLE_DTYPES)}{hint}"
        )
    if kind == "buffer" and tensor.dtype == torch.bfloat16:
        raise ConfigError(
            f"buffer '{name}' has dtype torch.bfloat16, which the job cannot hold; keep the "
            "model in float32 and compute in bfloat16 under torch.autocast"
        )


def _unscale(scaler: Any, opt: DistributedOptimizer, rows: dict[str, Any]) -> bool:
    """Unscales this step's gradients for ``scaler`` as ``scaler.step`` would; whether any is
    inf/NaN (then the step is skipped). Table rows, which the scaler does not see, are
    unscaled here and count too."""
    found = scaler._found_inf_per_device(opt)  # filled when the script called unscale_ itself
    if not found:
        scaler.unscale_(opt)
        found = scaler._found_inf_per_device(opt)
    skip = any(float(t.item()) > 0 for t in found.values())
    if rows:
        inv = np.float32(1.0 / np.float64(scaler.get_scale()))  # as torch: in float64
        # New RowSparse objects: they are frozen (``values *=`` would assign the field).
        for name, grad in rows.items():
            rows[name] = RowSparse(grad.ids, grad.values * inv)
        if not all(np.isfinite(g.values).all() for g in rows.values()):
            _found_inf(scaler, opt)
            skip = True
    return skip


def _found_inf(scaler: Any, opt: DistributedOptimizer) -> None:
    """Tells ``scaler`` this step was skipped, so its ``update()`` backs off (the scale
    shrinks) exactly as after its own inf/NaN."""
    for tensor in scaler._found_inf_per_device(opt).values():
        tensor.fill_(1.0)
