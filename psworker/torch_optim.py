"""torch.optim optimizers as the shards run them: which classes and options translate, each
parameter group's current hyper-parameters, and optimizer state between torch's format and the
shards' slots."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pscore.optim import (
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    Optimizer,
    RAdam,
    RMSprop,
)
from pswire.errors import ConfigError

# Flags that only pick a torch kernel: accepted, and the shards' math is the same.
IGNORED = ("foreach", "fused")
# Options that change the math (or need a step on the worker's own tensors): refused.
REFUSED = ("maximize", "capturable", "differentiable")
# Our hyper-parameter -> its key in a torch parameter group (betas hold beta1 and beta2).
_KEYS: dict[type[Optimizer], dict[str, str]] = {
    SGD: {k: k for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov")},
    Adam: {k: k for k in ("lr", "eps", "weight_decay", "amsgrad")}
    | {"beta1": "betas", "beta2": "betas"},
    Adagrad: {k: k for k in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")},
    RMSprop: {k: k for k in ("lr", "alpha", "eps", "weight_decay", "momentum", "centered")},
}
_BETAS = {"beta1": "betas", "beta2": "betas"}
_KEYS[AdamW] = _KEYS[Adam]
_KEYS[Adadelta] = {k: k for k in ("lr", "rho", "eps", "weight_decay")}
_KEYS[Adamax] = {k: k for k in ("lr", "eps", "weight_decay")} | _BETAS
_KEYS[NAdam] = {
    k: k for k in ("lr", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay")
} | _BETAS
_KEYS[RAdam] = {k: k for k in ("lr", "eps", "weight_decay", "decoupled_weight_decay")} | _BETAS
_TORCH = {
    torch.optim.SGD: SGD,
    torch.optim.Adam: Adam,
    torch.optim.AdamW: AdamW,
    torch.optim.Adagrad: Adagrad,
    torch.optim.RMSprop: RMSprop,
    torch.optim.Adadelta: Adadelta,
    torch.optim.Adamax: Adamax,
    torch.optim.NAdam: NAdam,
    torch.optim.RAdam: RAdam,
}
# Slots torch keeps as one number per parameter that the shards keep per element.
_PER_PARAMETER = ("mu_product",)
SUPPORTED = ", ".join(f"torch.optim.{c.__name__}" for c in _TORCH)


def spec_class(optimizer: torch.optim.Optimizer) -> type[Optimizer]:
    """The shards' optimizer class for a torch optimizer (its exact class: a subclass may
    change the math).

    Raises:
        ValueError: an unsupported class, naming it.
    """
    kind = type(optimizer)
    cls = _TORCH.get(kind)
    if cls is None:
        raise ConfigError(
            f"{kind.__module__}.{kind.__qualname__} is not supported by DistributedOptimizer; "
            f"supported: {SUPPORTED}"
        )
    if cls is Adam and any(g.get("decoupled_weight_decay") for g in optimizer.param_groups):
        return AdamW  # torch.optim.Adam(decoupled_weight_decay=True) is AdamW
    return cls


def group_spec(
    cls: type[Optimizer],
    group: Mapping[str, Any],
    kind: str,
    index: int,
    defaults: Mapping[str, Any] | None = None,
) -> Optimizer:
    """The shards' optimizer with ``group``'s current values (what a scheduler set);
    ``defaults``: the torch optimizer's.

    Raises:
        ValueError: a refused option set, a value missing or out of range, naming the class
            (``kind``), the group and the option.
    """
    where = f"torch.optim.{kind} parameter group {index}"
    for option in REFUSED:
        if group.get(option):
            raise ConfigError(
                f"{where}: {option}=True is not supported (the step runs on the parameter "
                f"servers with the plain math); supported: {sorted(set(_KEYS[cls].values()))}"
            )
    if cls is Adam and group.get("decoupled_weight_decay"):
        cls = AdamW
    kwargs: dict[str, Any] = {}
    for ours, theirs in _KEYS[cls].items():
        if theirs not in group:
            raise ConfigError(
                f"{where} has no '{theirs}' (a state_dict of another optimizer class?); it has "
                f"{sorted(k for k in group if k != 'params')}"
            )
        value = group[theirs]
        if theirs == "betas":
            value = value[0] if ours == "beta1" else value[1]
        if isinstance(value, torch.Tensor):
            value = value.item()
        kwargs[ours] = bool(value) if isinstance(value, bool) else float(value)
    if cls is Adagrad and defaults is not None:
        # torch.optim.Adagrad fills every group's sums from the constructor's value (a
        # group's own is ignored): so do we.
        kwargs["initial_accumulator_value"] = float(defaults["initial_accumulator_value"])
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def check_supported(optimizer: torch.optim.Optimizer) -> list[Optimizer]:
    """Each parameter group's shard optimizer, for a torch optimizer about to be wrapped.

    Raises:
        ValueError: an unsupported class or option (nothing has been sent yet).
    """
    cls = spec_class(optimizer)
    kind = type(optimizer).__name__
    defaults = optimizer.defaults
    return [group_spec(cls, g, kind, i, defaults) for i, g in enumerate(optimizer.param_groups)]


def torch_optimizer_for(
    spec: Optimizer, params: Sequence[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The torch optimizer with ``spec``'s hyper-parameters (for a ``psworker.SGD``-style spec,
    so that schedulers and state_dicts see a torch optimizer)."""
    p = spec.params()
    if isinstance(spec, SGD):
        return torch.optim.SGD(
            params,
            lr=p["lr"],
            momentum=p["momentum"],
            dampening=p["dampening"],
            weight_decay=p["weight_decay"],
            nesterov=bool(p["nesterov"]),
        )
    if isinstance(spec, Adam):
        kind = torch.optim.AdamW if isinstance(spec, AdamW) else torch.optim.Adam
        return kind(
            params,
            lr=p["lr"],
            betas=(p["beta1"], p["beta2"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            amsgrad=bool(p["amsgrad"]),
        )
    if isinstance(spec, Adagrad):
        return torch.optim.Adagrad(
            params,
            lr=p["lr"],
            lr_decay=p["lr_decay"],
            weight_decay=p["weight_decay"],
            initial_accumulator_value=p["initial_accumulator_value"],
            eps=p["eps"],
        )
    if isinstance(spec, RMSprop):
        return torch.optim.RMSprop(
            params,
            lr=p["lr"],
            alpha=p["alpha"],
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            momentum=p["momentum"],
            centered=bool(p["centered"]),
        )
    if isinstance(spec, Adadelta):
        return torch.optim.Adadelta(
            params, lr=p["lr"], rho=p["rho"], eps=p["eps"], weight_decay=p["weight_decay"]
        )
    if isinstance(spec, Adamax):
        return torch.optim.Adamax(
            params,
            lr=p["lr"],
            betas=(p["beta1"], p["beta2"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
        )
    if isinstance(spec, NAdam):
        return torch.optim.NAdam(
            params,
            lr=p["lr"],
            betas=(p["beta1"], p["beta2"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            momentum_decay=p["momentum_decay"],
            decoupled_weight_decay=bool(p["decoupled_weight_decay"]),
        )
    if isinstance(spec, RAdam):
        return torch.optim.RAdam(
            params,
            lr=p["lr"],
            betas=(p["beta1"], p["beta2"]),
            eps=p["eps"],
            weight_decay=p["weight_decay"],
            decoupled_weight_decay=bool(p["decoupled_weight_decay"]),
        )
    raise ConfigError(f"unknown optimizer spec {spec!r}")  # pragma: no cover


def changed_values(base: Optimizer, now: Optimizer) -> dict[str, float]:
    """The hyper-parameters of ``now`` that differ from ``base`` (what a push carries)."""
    before = base.params()
    return {k: v for k, v in now.params().items() if v != before[k]}


def slots_to_torch(
    cls: type[Optimizer], slots: Mapping[str, Any], param: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """A parameter's torch state from its shard slots; None where torch has none yet (before
    the parameter's first step; Adagrad makes its state at construction)."""
    if not slots or (cls is not Adagrad and slots.get("step", 1) == 0):
        return None
    out = {}
    for name, value in slots.items():
        if name in _PER_PARAMETER:  # one number in torch (every element of ours holds it)
            first = float(value.reshape(-1)[0]) if value.size else 1.0
            out[name] = torch.tensor(first, dtype=_scalar_dtype())
        elif isinstance(value, np.ndarray):
            out[name] = torch.from_numpy(np.array(value, copy=True)).to(param.device, param.dtype)
        else:  # the step count: a float tensor in torch's state
            out[name] = torch.tensor(float(value), dtype=_scalar_dtype())
    return out


def slots_from_torch(state: Mapping[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """A parameter's shard slots from its torch state (arrays; the step as an int; a number
    torch keeps per parameter, NAdam's ``mu_product``, as an array of ``param``'s shape)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if value is None:
            continue
        if name == "step":
            out[name] = round(float(value))
        elif name in _PER_PARAMETER:
            dtype = torch.empty(0, dtype=param.dtype).numpy().dtype
            out[name] = np.full(tuple(param.shape), float(value), dtype=dtype)
        else:
            out[name] = value.detach().cpu().numpy()
    return out


def state_digest(slots: Mapping[str, Mapping[str, Any]], groups: Sequence[Optimizer]) -> str:
    """A digest of a loaded state (every slot's bytes, every group's hyper-parameters): equal
    on workers that loaded the same state_dict."""
    h = hashlib.sha256(json.dumps([[g.name, g.params()] for g in groups]).encode())
    for name in sorted(slots):
        for slot in sorted(slots[name]):
            value = slots[name][slot]
            if isinstance(value, np.ndarray):
                h.update(json.dumps([name, slot, value.dtype.str, list(value.shape)]).encode())
                h.update(np.ascontiguousarray(value).tobytes())
            else:
                h.update(json.dumps([name, slot, int(value)]).encode())
    return h.hexdigest()[:32]


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps step counts as float32 (float64 when that is the default dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
