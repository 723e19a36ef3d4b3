"""Optimizers in numpy, in place, with torch.optim's math: run on shards and in local modes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from pswire.errors import InvalidRequestError

# apply_blocked's piece: 1M elements (4 MiB of float32) keeps temporaries small and each numpy
# call long enough that the per-call overhead does not show.
DEFAULT_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Optimizer:
    """Hyper-parameters of an optimizer; ``make_state``/``apply`` hold the math."""

    name: ClassVar[str] = ""
    lr: float = 0.01

    def _check_ranges(self, **bounds: tuple[float, float]) -> None:
        """Raises ValueError for a hyper-parameter outside [low, high) (torch.optim's checks)."""
        for key, (low, high) in {"lr": (0.0, float("inf")), **bounds}.items():
            value = getattr(self, key)
            if not low <= value < high:
                raise ValueError(f"invalid {key}: {value} (expected {low} <= {key} < {high})")

    def params(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {}

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
            raise ValueError("nesterov needs momentum > 0 and dampening 0")

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"momentum_buffer": None} if self.momentum else {}

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
    """torch.optim.Adam (without amsgrad); weight decay added to the gradient, L2 style."""

    name: ClassVar[str] = "adam"
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self._check_ranges(
            beta1=(0.0, 1.0),
            beta2=(0.0, 1.0),
            eps=(0.0, float("inf")),
            weight_decay=(0.0, float("inf")),
        )

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {"step": 0, "exp_avg": np.zeros_like(param), "exp_avg_sq": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        if self.weight_decay:
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
        bias1 = 1 - self.beta1**step
        bias2_sqrt = (1 - self.beta2**step) ** 0.5
        np.sqrt(v, out=tmp)
        tmp /= t(bias2_sqrt)
        tmp += t(self.eps)
        np.divide(m, tmp, out=tmp)
        tmp *= t(self.lr / bias1)
        param -= tmp


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


OPTIMIZERS: dict[str, type[Optimizer]] = {cls.name: cls for cls in (SGD, Adam, Adagrad)}


def optimizer_from_spec(name: str, params: dict[str, float]) -> Optimizer:
    """Builds an optimizer from its wire form.

    Raises:
        InvalidRequestError: unknown optimizer, unknown or invalid hyper-parameter.
    """
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise InvalidRequestError(
            f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}"
        )
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
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise InvalidRequestError(f"optimizer {name!r}: {exc}") from exc
