"""Optimizers in numpy, in place, with torch.optim's math: run on shards and in local modes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from pswire.errors import ConfigError

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
        self._check_ranges(eps=(0.0, _INF), weight_decay=(0.0, _INF))
        if not 0.0 <= self.rho <= 1.0:
            raise ConfigError(f"invalid rho: {self.rho} (expected 0.0 <= rho <= 1.0)")

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "square_avg": np.zeros_like(param), "acc_delta": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        grad = _decayed(self.lr, self.weight_decay, False, param, grad)
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]
        tmp = np.empty_like(param)
        _average_squares(square_avg, grad, self.rho, tmp)
        std = np.sqrt(square_avg + t(self.eps))
        delta = np.sqrt(acc_delta + t(self.eps))
        delta /= std
        delta *= grad
        _average_squares(acc_delta, delta, self.rho, tmp)
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
        self._check_ranges(**_BETAS, eps=(0.0, _INF), weight_decay=(0.0, _INF))

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "exp_avg": np.zeros_like(param), "exp_inf": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        grad = _decayed(self.lr, self.weight_decay, False, param, grad)
        exp_avg, exp_inf = state["exp_avg"], state["exp_inf"]
        tmp = np.empty_like(param)
        _lerp(exp_avg, grad, t(1 - self.beta1), tmp)
        exp_inf *= t(self.beta2)
        np.abs(grad, out=tmp)
        tmp += t(self.eps)
        np.maximum(exp_inf, tmp, out=exp_inf)
        np.divide(exp_avg, exp_inf, out=tmp)  # addcdiv: param + value * (exp_avg / exp_inf)
        tmp *= t(self.lr / (1 - self.beta1 ** state["step"]))
        param -= tmp


@dataclass(frozen=True)
class NAdam(Optimizer):
    """torch.optim.NAdam: momentum decay, weight decay (L2, or decoupled as AdamW's).
    ``mu_product`` (one number per parameter in torch) is an array here, every element equal,
    so that every slot is cut and checkpointed alike: one array more memory than torch."""

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
        inf = (0.0, _INF)
        self._check_ranges(**_BETAS, eps=inf, weight_decay=inf, momentum_decay=inf)

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        zeros = {k: np.zeros_like(param) for k in ("exp_avg", "exp_avg_sq")}
        return {"step": 0, "mu_product": np.ones_like(param), **zeros}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        step = state["step"]
        grad = _decayed(self.lr, self.weight_decay, self.decoupled_weight_decay, param, grad)
        mu = self.beta1 * (1.0 - 0.5 * (0.96 ** (step * self.momentum_decay)))
        mu_next = self.beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * self.momentum_decay)))
        state["mu_product"] *= t(mu)  # torch's product is float32 too: the same rounding
        if param.size == 0:
            return
        product = float(state["mu_product"].flat[0])
        tmp = np.empty_like(param)
        _lerp(state["exp_avg"], grad, t(1 - self.beta1), tmp)
        _average_squares(state["exp_avg_sq"], grad, self.beta2, tmp)
        denom = np.sqrt(state["exp_avg_sq"] / t(1 - self.beta2**step))
        denom += t(self.eps)
        np.divide(grad, denom, out=tmp)
        tmp *= t(-self.lr * (1.0 - mu) / (1.0 - product))
        param += tmp
        np.divide(state["exp_avg"], denom, out=tmp)
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
        self._check_ranges(**_BETAS, eps=(0.0, _INF), weight_decay=(0.0, _INF))

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "exp_avg": np.zeros_like(param), "exp_avg_sq": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        state["step"] += 1
        step = state["step"]
        grad = _decayed(self.lr, self.weight_decay, self.decoupled_weight_decay, param, grad)
        tmp = np.empty_like(param)
        _lerp(state["exp_avg"], grad, t(1 - self.beta1), tmp)
        _average_squares(state["exp_avg_sq"], grad, self.beta2, tmp)
        bias2 = 1 - self.beta2**step
        update = state["exp_avg"] / t(1 - self.beta1**step)
        update *= t(self.lr)
        rho_inf = 2 / (1 - self.beta2) - 1
        rho_t = rho_inf - 2 * step * (self.beta2**step) / bias2
        if rho_t > 5.0:  # the variance is tractable: rectify, and scale by the adaptive lr
            rect = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            np.sqrt(state["exp_avg_sq"], out=tmp)
            tmp += t(self.eps)
            np.divide(t(bias2**0.5), tmp, out=tmp)
            update *= tmp
            update *= t(rect**0.5)
        param -= update


_INF = float("inf")
_BETAS = {"beta1": (0.0, 1.0), "beta2": (0.0, 1.0)}


def _decayed(
    lr: float, weight_decay: float, decoupled: bool, param: np.ndarray, grad: np.ndarray
) -> np.ndarray:
    """Weight decay as torch applies it: decoupled, the weights shrink by ``lr *
    weight_decay`` in place; else it is added to the (returned) gradient."""
    if weight_decay and decoupled:
        param *= param.dtype.type(1 - lr * weight_decay)
    elif weight_decay:
        return grad + param * param.dtype.type(weight_decay)
    return grad


def _average_squares(avg: np.ndarray, x: np.ndarray, keep: float, tmp: np.ndarray) -> None:
    """``avg.mul_(keep).addcmul_(x, x, value=1 - keep)`` as torch computes it, in place."""
    avg *= avg.dtype.type(keep)
    np.multiply(x, avg.dtype.type(1 - keep), out=tmp)
    tmp *= x
    avg += tmp


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
