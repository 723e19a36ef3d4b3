"""Optimizers in numpy, in place, with torch.optim's math: run on shards and in local modes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np

from pswire.errors import ConfigError, InvalidRequestError

# apply_blocked's piece: 1M elements (4 MiB of float32) keeps temporaries small and each numpy
# call long enough that the per-call overhead does not show.
DEFAULT_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Optimizer:
    """Hyper-parameters of an optimizer; ``make_state``/``apply`` hold the math."""

    name: ClassVar[str] = ""
    # Whether it has a row-sparse form (embedding tables: ``apply_rows``, lazy like
    # torch.optim.SparseAdam); those without one are refused for tables.
    sparse: ClassVar[bool] = True
    lr: float = 0.01

    def _check_ranges(self, **bounds: tuple[float, float]) -> None:
        """Raises ConfigError for a hyper-parameter outside [low, high) (torch.optim's checks)."""
        for key, (low, high) in {"lr": (0.0, float("inf")), **bounds}.items():
            value = getattr(self, key)
            if not low <= value < high:
                raise ConfigError(f"invalid {key}: {value} (expected {low} <= {key} < {high})")

    def params(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {}

    def layout(self) -> tuple:
        """What decides the slots ``make_state`` makes (e.g. momentum on or off): fixed for a
        job's life, as torch's state is made once (a later change is refused)."""
        return ()

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        """Updates ``param`` in place from ``grad``; ``state`` is this variable's slot dict."""
        raise NotImplementedError

    def apply_blocked(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        state: dict[str, Any],
        block: int = DEFAULT_BLOCK_ELEMENTS,
    ) -> None:
        """``apply`` on ``block``-element pieces of a large variable in turn: the same result
        bit for bit (every optimizer here is elementwise), with temporaries of one piece
        instead of the whole variable. Scalar slots (the step count) advance once."""
        if param.size <= block or not param.flags.c_contiguous:
            self.apply(param, grad, state)
            return
        flat = param.reshape(-1)
        flat_grad = np.ascontiguousarray(grad).reshape(-1)
        arrays = {k: v.reshape(-1) for k, v in state.items() if isinstance(v, np.ndarray)}
        made = {k: np.empty_like(flat) for k, v in state.items() if v is None}  # lazy slots
        after: dict[str, Any] = {}
        for start in range(0, flat.size, block):
            part = slice(start, start + block)
            sub = {k: arrays[k][part] if k in arrays else v for k, v in state.items()}
            self.apply(flat[part], flat_grad[part], sub)
            for key, whole in made.items():  # the first step made this piece of the slot
                whole[part] = sub[key]
            after = {k: v for k, v in sub.items() if k not in arrays and k not in made}
        state.update(after)
        state.update({k: whole.reshape(param.shape) for k, whole in made.items()})

    def apply_rows(
        self, param: np.ndarray, rows: np.ndarray, grad: np.ndarray, state: dict[str, Any]
    ) -> None:
        """A row-sparse step: ``apply``'s math on rows ``rows`` (unique) of ``param`` and of its
        slot arrays; other rows and their slots stay as they are (lazy, like
        ``torch.optim.SparseAdam``); scalar slots such as the step count advance once."""
        part = param[rows]
        sub = {k: (v[rows] if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        self.apply(part, np.asarray(grad, dtype=param.dtype), sub)
        param[rows] = part
        for key, value in sub.items():
            if isinstance(state[key], np.ndarray):
                state[key][rows] = value
            else:
                state[key] = value


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD: momentum, dampening, nesterov, weight decay."""

    name: ClassVar[str] = "sgd"
    lr: float = 0.001  # torch.optim.SGD's default (tests/unit/test_caught_optim.py)
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self._check_ranges(momentum=(0.0, float("inf")), weight_decay=(0.0, float("inf")))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("nesterov needs momentum > 0 and dampening 0")

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"momentum_buffer": None} if self.momentum else {}

    def layout(self) -> tuple:
        return (self.momentum != 0,)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        d_p = grad
        if self.weight_decay:
            d_p = grad + param * param.dtype.type(self.weight_decay)
        if self.momentum:
            buf = state["momentum_buffer"]
            if buf is None:
                buf = state["momentum_buffer"] = np.array(d_p, dtype=param.dtype, copy=True)
            else:
                buf *= param.dtype.type(self.momentum)
                if self.dampening:
                    buf += d_p * param.dtype.type(1 - self.dampening)
                else:  # times 1.0 is exact: skip the temporary
                    buf += d_p
            d_p = d_p + buf * param.dtype.type(self.momentum) if self.nesterov else buf
        param -= d_p * param.dtype.type(self.lr)


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam, amsgrad included; weight decay added to the gradient, L2 style."""

    name: ClassVar[str] = "adam"
    decoupled: ClassVar[bool] = False  # AdamW: decay the weights, not the gradient
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    def __post_init__(self) -> None:
        self._check_ranges(
            beta1=(0.0, 1.0),
            beta2=(0.0, 1.0),
            eps=(0.0, float("inf")),
            weight_decay=(0.0, float("inf")),
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        state = {"step": 0, "exp_avg": np.zeros_like(param), "exp_avg_sq": np.zeros_like(param)}
        if self.amsgrad:
            state["max_exp_avg_sq"] = np.zeros_like(param)
        return state

    def layout(self) -> tuple:
        return (self.amsgrad,)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        if self.weight_decay and self.decoupled:
            param *= t(1 - self.lr * self.weight_decay)
        elif self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        state["step"] += 1
        step = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # One scratch array serves every intermediate (same operations, same rounding order as
        # the plain expressions, without their four temporaries).
        tmp = np.empty_like(param)  # an array even for a 0-d variable (a ufunc gives a scalar)
        np.multiply(grad, t(1 - self.beta1), out=tmp)
        m *= t(self.beta1)
        m += tmp
        np.multiply(grad, grad, out=tmp)
        tmp *= t(1 - self.beta2)
        v *= t(self.beta2)
        v += tmp
        if self.amsgrad:
            v = state["max_exp_avg_sq"]
            np.maximum(v, state["exp_avg_sq"], out=v)
        bias1 = 1 - self.beta1**step
        bias2_sqrt = (1 - self.beta2**step) ** 0.5
        np.sqrt(v, out=tmp)
        tmp /= t(bias2_sqrt)
        tmp += t(self.eps)
        np.divide(m, tmp, out=tmp)
        tmp *= t(self.lr / bias1)
        param -= tmp


@dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (the weights shrink by
    ``lr * weight_decay`` before the step; the gradient is left alone)."""

    name: ClassVar[str] = "adamw"
    decoupled: ClassVar[bool] = True
    weight_decay: float = 0.01


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad: lr decay, weight decay, initial accumulator value."""

    name: ClassVar[str] = "adagrad"
    lr: float = 0.01
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        inf = float("inf")
        self._check_ranges(
            lr_decay=(0.0, inf),
            weight_decay=(0.0, inf),
            initial_accumulator_value=(0.0, inf),
            eps=(0.0, inf),
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "sum": np.full_like(param, self.initial_accumulator_value)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        if self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        state["step"] += 1
        clr = self.lr / (1 + (state["step"] - 1) * self.lr_decay)
        acc = state["sum"]
        acc += grad * grad
        std = np.sqrt(acc)
        std += t(self.eps)
        param -= (grad / std) * t(clr)


@dataclass(frozen=True)
class RMSprop(Optimizer):
    """torch.optim.RMSprop: smoothing ``alpha``, momentum, centered, weight decay."""

    name: ClassVar[str] = "rmsprop"
    lr: float = 0.01
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    def __post_init__(self) -> None:
        inf = float("inf")
        self._check_ranges(
            alpha=(0.0, inf), eps=(0.0, inf), weight_decay=(0.0, inf), momentum=(0.0, inf)
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0, "square_avg": np.zeros_like(param)}
        if self.momentum > 0:
            state["momentum_buffer"] = np.zeros_like(param)
        if self.centered:
            state["grad_avg"] = np.zeros_like(param)
        return state

    def layout(self) -> tuple:
        return (self.momentum > 0, self.centered)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        if self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        state["step"] += 1
        square_avg = state["square_avg"]
        tmp = np.empty_like(param)
        square_avg *= t(self.alpha)
        np.multiply(grad, t(1 - self.alpha), out=tmp)  # addcmul: value * grad * grad
        tmp *= grad
        square_avg += tmp
        avg = np.empty_like(param)
        if self.centered:
            grad_avg = state["grad_avg"]
            _lerp(grad_avg, grad, t(1 - self.alpha), tmp)
            np.multiply(grad_avg, grad_avg, out=tmp)
            np.subtract(square_avg, tmp, out=avg)
            np.sqrt(avg, out=avg)
        else:
            np.sqrt(square_avg, out=avg)
        avg += t(self.eps)
        if self.momentum > 0:
            buf = state["momentum_buffer"]
            buf *= t(self.momentum)
            np.divide(grad, avg, out=tmp)
            buf += tmp
            np.multiply(buf, t(self.lr), out=tmp)
        else:
            np.divide(grad, avg, out=tmp)
            tmp *= t(self.lr)
        param -= tmp


@dataclass(frozen=True)
class Adadelta(Optimizer):
    """torch.optim.Adadelta: ``rho``, ``eps``, weight decay (L2, added to the gradient)."""

    name: ClassVar[str] = "adadelta"
    sparse: ClassVar[bool] = False
    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        inf = float("inf")
        self._check_ranges(eps=(0.0, inf), weight_decay=(0.0, inf))
        if not 0.0 <= self.rho <= 1.0:
            raise ConfigError(f"invalid rho: {self.rho} (expected 0.0 <= rho <= 1.0)")

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "square_avg": np.zeros_like(param), "acc_delta": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        if self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]
        tmp = np.empty_like(param)
        square_avg *= t(self.rho)
        np.multiply(grad, t(1 - self.rho), out=tmp)  # addcmul: value * grad * grad
        tmp *= grad
        square_avg += tmp
        std = square_avg + t(self.eps)
        np.sqrt(std, out=std)
        delta = acc_delta + t(self.eps)
        np.sqrt(delta, out=delta)
        delta /= std
        delta *= grad
        acc_delta *= t(self.rho)
        np.multiply(delta, t(1 - self.rho), out=tmp)
        tmp *= delta
        acc_delta += tmp
        delta *= t(self.lr)
        param -= delta


@dataclass(frozen=True)
class Adamax(Optimizer):
    """torch.optim.Adamax: Adam with the infinity norm; weight decay added to the gradient."""

    name: ClassVar[str] = "adamax"
    sparse: ClassVar[bool] = False
    lr: float = 0.002
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        inf = float("inf")
        self._check_ranges(
            beta1=(0.0, 1.0), beta2=(0.0, 1.0), eps=(0.0, inf), weight_decay=(0.0, inf)
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "exp_avg": np.zeros_like(param), "exp_inf": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        if self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        exp_avg, exp_inf = state["exp_avg"], state["exp_inf"]
        tmp = np.empty_like(param)
        _lerp(exp_avg, grad, t(1 - self.beta1), tmp)
        exp_inf *= t(self.beta2)
        np.abs(grad, out=tmp)
        tmp += t(self.eps)
        np.maximum(exp_inf, tmp, out=exp_inf)
        clr = self.lr / (1 - self.beta1 ** state["step"])
        np.divide(exp_avg, exp_inf, out=tmp)  # addcdiv: param + value * (exp_avg / exp_inf)
        tmp *= t(clr)
        param -= tmp


@dataclass(frozen=True)
class NAdam(Optimizer):
    """torch.optim.NAdam: momentum decay, weight decay (L2, or decoupled as AdamW's).

    ``mu_product`` (torch keeps one number per parameter) is an array here, every element
    equal, so that every slot of a variable is cut and checkpointed alike: one array more
    of memory than torch.
    """

    name: ClassVar[str] = "nadam"
    sparse: ClassVar[bool] = False
    lr: float = 0.002
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        inf = float("inf")
        self._check_ranges(
            beta1=(0.0, 1.0),
            beta2=(0.0, 1.0),
            eps=(0.0, inf),
            weight_decay=(0.0, inf),
            momentum_decay=(0.0, inf),
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {
            "step": 0,
            "mu_product": np.ones_like(param),
            "exp_avg": np.zeros_like(param),
            "exp_avg_sq": np.zeros_like(param),
        }

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        step = state["step"]
        if self.weight_decay and self.decoupled_weight_decay:
            param *= t(1 - self.lr * self.weight_decay)
        elif self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        mu = self.beta1 * (1.0 - 0.5 * (0.96 ** (step * self.momentum_decay)))
        mu_next = self.beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * self.momentum_decay)))
        mu_product = state["mu_product"]
        mu_product *= t(mu)  # torch's product is float32 too: the same rounding
        if param.size == 0:
            return
        product = float(mu_product.flat[0])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        tmp = np.empty_like(param)
        _lerp(exp_avg, grad, t(1 - self.beta1), tmp)
        exp_avg_sq *= t(self.beta2)
        np.multiply(grad, t(1 - self.beta2), out=tmp)
        tmp *= grad
        exp_avg_sq += tmp
        denom = exp_avg_sq / t(1 - self.beta2**step)
        np.sqrt(denom, out=denom)
        denom += t(self.eps)
        np.divide(grad, denom, out=tmp)
        tmp *= t(-self.lr * (1.0 - mu) / (1.0 - product))
        param += tmp
        np.divide(exp_avg, denom, out=tmp)
        tmp *= t((-self.lr * mu_next) / (1.0 - product * mu_next))
        param += tmp


@dataclass(frozen=True)
class RAdam(Optimizer):
    """torch.optim.RAdam: rectified Adam; weight decay L2, or decoupled as AdamW's."""

    name: ClassVar[str] = "radam"
    sparse: ClassVar[bool] = False
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        inf = float("inf")
        self._check_ranges(
            beta1=(0.0, 1.0), beta2=(0.0, 1.0), eps=(0.0, inf), weight_decay=(0.0, inf)
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "exp_avg": np.zeros_like(param), "exp_avg_sq": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        step = state["step"]
        if self.weight_decay and self.decoupled_weight_decay:
            param *= t(1 - self.lr * self.weight_decay)
        elif self.weight_decay:
            grad = grad + param * t(self.weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        tmp = np.empty_like(param)
        _lerp(exp_avg, grad, t(1 - self.beta1), tmp)
        exp_avg_sq *= t(self.beta2)
        np.multiply(grad, t(1 - self.beta2), out=tmp)
        tmp *= grad
        exp_avg_sq += tmp
        bias1 = 1 - self.beta1**step
        bias2 = 1 - self.beta2**step
        update = exp_avg / t(bias1)
        update *= t(self.lr)
        rho_inf = 2 / (1 - self.beta2) - 1
        rho_t = rho_inf - 2 * step * (self.beta2**step) / bias2
        if rho_t > 5.0:
            rect = (
                (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            ) ** 0.5
            np.sqrt(exp_avg_sq, out=tmp)
            tmp += t(self.eps)
            np.divide(t(bias2**0.5), tmp, out=tmp)  # the adaptive lr
            update *= tmp
            update *= t(rect)
        param -= update


def _lerp(value: np.ndarray, end: np.ndarray, weight: Any, tmp: np.ndarray) -> None:
    """``value.lerp_(end, weight)`` as torch computes it, in place (``tmp``: scratch)."""
    np.subtract(end, value, out=tmp)
    if weight < 0.5:
        tmp *= weight
        value += tmp
    else:
        tmp *= type(weight)(1) - weight
        np.subtract(end, tmp, out=value)


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta, Adamax, NAdam, RAdam)
}


def optimizer_from_spec(name: str, params: Mapping[str, float]) -> Optimizer:
    """Builds an optimizer from its wire form.

    Raises:
        InvalidRequestError: unknown optimizer, unknown or invalid hyper-parameter.
    """
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise InvalidRequestError(
            f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}"
        )
    try:
        return cls(**_kwargs(cls, params))
    except ValueError as exc:
        raise InvalidRequestError(f"optimizer {name!r}: {exc}") from exc


def with_values(base: Optimizer, values: Mapping[str, float], where: str = "") -> Optimizer:
    """``base`` with some hyper-parameters replaced (an lr a scheduler changed, ...).

    Raises:
        InvalidRequestError: an unknown or invalid value, or one that would change which
            optimizer slots exist (``layout``: e.g. momentum switched on), naming ``where``.
    """
    if not values:
        return base
    prefix = f"{where}: " if where else ""
    try:
        changed = replace(base, **_kwargs(type(base), values))
    except (ValueError, InvalidRequestError) as exc:
        raise InvalidRequestError(f"{prefix}optimizer {base.name!r}: {exc}") from exc
    if changed.layout() != base.layout():
        diff = {k: v for k, v in changed.params().items() if base.params()[k] != v}
        raise InvalidRequestError(
            f"{prefix}optimizer {base.name!r}: {diff} would change which optimizer state "
            f"exists (was {base.params()}); that is fixed when the job starts"
        )
    return changed


def _kwargs(cls: type[Optimizer], params: Mapping[str, float]) -> dict[str, Any]:
    """Constructor arguments from wire values (doubles), checked.

    Raises:
        InvalidRequestError: unknown name, non-finite value, a flag that is not 0 or 1.
    """
    name = cls.name
    known = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in known:
            raise InvalidRequestError(
                f"optimizer {name!r} has no parameter {key!r}; expected one of {sorted(known)}"
            )
        if not np.isfinite(value):
            raise InvalidRequestError(f"optimizer {name!r} parameter {key!r} is {value}")
        if known[key] in (bool, "bool"):
            # The wire carries doubles: a flag is 0 or 1, anything else is a mistake, not True.
            if value not in (0, 1):
                raise InvalidRequestError(
                    f"optimizer {name!r} parameter {key!r} is a flag, got {value}; expected 0 or 1"
                )
            kwargs[key] = bool(value)
        else:
            kwargs[key] = float(value)
    return kwargs


@dataclass(frozen=True)
class StepOptions:
    """What a push says beside its gradients.

    ``values``: per parameter group (index), hyper-parameters that replace the job's for this
    update (an lr a scheduler set, ...); groups and names left out keep the job's values.
    ``skip``: this worker's step is skipped (a GradScaler found inf/NaN in its gradients):
    the push carries no gradients (buffers only), and no optimizer step is taken with it (in
    ``sync``, none for that step at all).
    """

    values: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    skip: bool = False


NO_OPTIONS = StepOptions()


def group_optimizers(
    groups: Sequence[Optimizer], options: StepOptions | None
) -> tuple[Optimizer, ...]:
    """Each parameter group's optimizer for one update: ``groups`` with ``options.values``.

    Raises:
        InvalidRequestError: a group index out of range, or a bad value (naming the group).
    """
    out = tuple(groups)
    if options is None or not options.values:
        return out
    changed = list(out)
    for index, values in options.values.items():
        if not 0 <= index < len(out):
            raise InvalidRequestError(
                f"hyper-parameters for parameter group {index}; the job has groups "
                f"0..{len(out) - 1}"
            )
        changed[index] = with_values(out[index], values, f"parameter group {index}")
    return tuple(changed)


def resolve_groups(
    optimizer: Optimizer | Sequence[Optimizer],
    groups: Mapping[str, int] | None,
    names: Sequence[str],
) -> tuple[tuple[Optimizer, ...], dict[str, int]]:
    """(every group's optimizer, each of ``names``' group) from what a worker's ``init`` got:
    one optimizer, or one per parameter group (of any classes: two models' optimizers in one
    job), and the groups of some names (others: 0).

    Raises:
        InvalidRequestError: no optimizer, a group for a name the model lacks or out of
            range.
    """
    optimizers = (optimizer,) if isinstance(optimizer, Optimizer) else tuple(optimizer)
    if not optimizers:
        raise InvalidRequestError("no optimizer: give one, or one per parameter group")
    given = dict(groups or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidRequestError(f"parameter groups name {unknown}, which the model lacks")
    bad = {n: g for n, g in given.items() if not 0 <= g < len(optimizers)}
    if bad:
        raise InvalidRequestError(
            f"parameter groups {bad} out of range: there are {len(optimizers)} optimizers"
        )
    return optimizers, {n: given.get(n, 0) for n in names}
