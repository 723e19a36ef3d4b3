"""Optimizers in numpy, in place, with torch.optim's math: run on shards and in local modes."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from pswire.errors import ConfigError

# apply_blocked's piece: 64K elements (256 KiB of float32). Every array a step touches (the
# variable, its gradient, its slots and one scratch block) then fits in a core's L2 cache, so a
# step reads and writes each array once from memory however many numpy calls it takes: with
# 1M-element pieces each call was its own pass over memory (SGD momentum 0.30x torch.optim's
# speed at 25M parameters, Adam 0.67x). Smaller pieces spend more in per-call overhead.
DEFAULT_BLOCK_ELEMENTS = 1 << 16

_scratch_local = threading.local()
_T = TypeVar("_T")

# A derived bound (``Optimizer.result_bound``) allows this much per norm for rounding: 9
# float32 roundings in a row scale a norm by at most (1 + 2**-24)**9 < 1 + 6e-7.
ROUNDING = 1.0 + 1e-6
_PROVEN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# Threads that apply a large variable's pieces at once (torch.optim's elementwise kernels use
# every core too); each piece is the same elementwise step, so the result does not depend on
# the count.
OPTIMIZER_THREADS = min(
    8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
)
# Pieces each thread must have before another thread is woken: a wake-up and the pool's
# hand-off cost as much as several pieces (far more on a loaded machine), so a small step runs
# in the calling thread: 262,144 elements took 279 us on 1 thread and 433 us on 2 (NOTES.md
# 25); a 1M-param model's 10-piece embedding 1.42 ms on 1, 1.87 ms on 2 (NOTES.md 35). 16
# pieces is 1M elements; at 8, variables of 16-31 pieces took 2 threads and were slower
# than on one in 9 of 10 interleaved pairs (SGD momentum, Adam, rows: bench/NOTES.md 37).
PIECES_PER_THREAD = 16
_pool_lock = threading.Lock()
_pool_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """The process's optimizer threads, started on first use; they hold no state between
    steps (a forked child starts its own: see ``_forget_pool``)."""
    global _pool_executor
    with _pool_lock:
        if _pool_executor is None:
            _pool_executor = ThreadPoolExecutor(OPTIMIZER_THREADS, "optimizer")
        return _pool_executor


def _forget_pool() -> None:
    """In a forked child: the parent's threads did not come along, so start afresh."""
    global _pool_executor, _pool_lock
    _pool_executor, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def run_pieces(count: int, run: Callable[[int, int], _T]) -> list[_T]:
    """``run(first, last)`` over pieces ``0..count-1``: whole in this thread, or, once each
    thread would have ``PIECES_PER_THREAD`` pieces, as contiguous ranges on the optimizer
    threads at once (numpy lets go of the GIL inside each call). The results in range order,
    so whatever combines them does it in the same order whatever the threads."""
    threads = min(OPTIMIZER_THREADS, count // PIECES_PER_THREAD) or 1
    if threads == 1:
        return [run(0, count)]
    bounds = [count * i // threads for i in range(threads + 1)]
    return list(_pool().map(run, bounds[:-1], bounds[1:]))


def scratch(like: np.ndarray, index: int = 0) -> np.ndarray:
    """An uninitialised array shaped and typed as ``like``, for an optimizer's intermediate
    results: up to ``DEFAULT_BLOCK_ELEMENTS`` elements, a view of a buffer this thread keeps
    (``index``: which one, for a step that needs two at once), so a blocked step allocates
    nothing per piece; larger, a new array (nothing that large is kept)."""
    if like.size > DEFAULT_BLOCK_ELEMENTS:
        return np.empty_like(like)
    buffers: dict[tuple[np.dtype, int], np.ndarray] = _scratch_local.__dict__.setdefault(
        "buffers", {}
    )
    buf = buffers.get((like.dtype, index))
    if buf is None or buf.size < like.size:  # grown by doubling, up to a piece
        size = min(DEFAULT_BLOCK_ELEMENTS, 1 << max(10, (like.size - 1).bit_length()))
        buf = buffers[(like.dtype, index)] = np.empty(size, like.dtype)
    return buf[: like.size].reshape(like.shape)


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
        # Fields read directly: asdict deep-copies each value, a measurable part of a small
        # step (the shard's overflow guard reads them every update).
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    def make_state(self, param: np.ndarray) -> dict[str, Any]:
        return {}

    def layout(self) -> tuple:
        """What decides the slots ``make_state`` makes (e.g. momentum on or off): fixed for a
        job's life, as torch's state is made once (a later change is refused)."""
        return ()

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        """Updates ``param`` in place from ``grad``; ``state`` is this variable's slot dict."""
        raise NotImplementedError

    def result_bound(self, dtype: np.dtype, squares: float, grad_squares: float) -> float | None:
        """An upper bound on the largest sum of squares among one ``apply``'s results (the
        variable and each array slot), from ``squares`` (one on the inputs': the variable's
        and its slots') and ``grad_squares`` (the gradient's), for a step the caller found
        safe: finite inputs, every sum of squares at most 1e30, every hyper-parameter at
        most 1e6 in size (``pscore.variables``' ``SAFE_SUM_SQUARES``, ``HYPER_SAFE``). Only
        for an optimizer whose results are then finite by proof: the caller skips measuring
        them and keeps the bound for the next step's overflow guard. None (the default):
        the results must be measured (a division or square root can make NaN or inf from
        finite inputs, e.g. Adam's 0 / (0 + eps) with eps 0)."""
        return None

    def apply_blocked(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        state: dict[str, Any],
        block: int = DEFAULT_BLOCK_ELEMENTS,
        measure: bool = False,
    ) -> float | None:
        """``apply`` on ``block``-element pieces of a large variable in turn: the same result
        bit for bit (every optimizer here is elementwise), with each piece's arrays in cache
        while the whole step runs on it. Scalar slots (the step count) advance once.

        ``measure``: also returns the largest sum of squares among the results (the variable
        and each array slot), summed piece by piece while each piece is still in cache: NaN
        or inf when some result is not finite (or is finite but large enough to overflow a
        piece's float sum: the caller then checks exactly). None when the variable was
        applied whole (no larger than a piece, or not contiguous): the caller measures it."""
        if param.size <= block or not param.flags.c_contiguous:
            self.apply(param, grad, state)
            return None
        measure = measure and param.dtype.kind == "f"
        flat = param.reshape(-1)
        flat_grad = np.ascontiguousarray(grad).reshape(-1)
        arrays = {k: v.reshape(-1) for k, v in state.items() if isinstance(v, np.ndarray)}
        made = {k: np.empty_like(flat) for k, v in state.items() if v is None}  # lazy slots
        starts = range(0, flat.size, block)
        errors = np.geterr()  # the caller's (numpy keeps them per thread)

        def run(first: int, last: int) -> tuple[dict[str, Any], list[list[float]]]:
            """Pieces ``first`` to ``last``: the scalar slots after, and each piece's sums."""
            after: dict[str, Any] = {}
            sums: list[list[float]] = []
            with np.errstate(**errors):
                for start in starts[first:last]:
                    part = slice(start, start + block)
                    sub = {k: arrays[k][part] if k in arrays else v for k, v in state.items()}
                    self.apply(flat[part], flat_grad[part], sub)
                    for key, whole in made.items():  # the first step made this piece
                        whole[part] = sub[key]
                    if measure:
                        results = [flat[part], *(v for v in sub.values() if _is_array(v))]
                        sums.append([float(np.dot(r, r)) for r in results])
                    after = {k: v for k, v in sub.items() if k not in arrays and k not in made}
            return after, sums

        done = run_pieces(len(starts), run)
        state.update(done[-1][0])
        state.update({k: whole.reshape(param.shape) for k, whole in made.items()})
        if not measure:
            return None
        # Summed in piece order whatever the threads (the same result every time); np.max,
        # not max(): max(5.0, nan) is 5.0.
        per_piece = [piece for _, sums in done for piece in sums]
        return float(np.max(np.sum(per_piece, axis=0)))


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

    def result_bound(self, dtype: np.dtype, squares: float, grad_squares: float) -> float | None:
        """SGD's results are finite, and bounded, from the inputs alone (float32, float64).

        Proof of finiteness. The step (``apply``) is products and sums only: d = g + wd*p;
        b' = m*b + (1 - dampening)*d (b' = d on the first step); n = d + m*b' with nesterov,
        else n = b'; p' = p - lr*n. No division, square root or inf - inf: with finite
        operands a result is NaN or inf only when a magnitude passes the dtype's largest
        finite value (float32: 3.4e38). Safe inputs have |p|, |b|, |g| <= 1e15 (a value's
        square is at most its array's sum of squares, 1e30) and every hyper-parameter,
        dampening included, at most 1e6 in size. Then |d| <= 1e15 + 1e6 * 1e15 < 1.01e21;
        without nesterov |b'| <= 1e6 * 1e15 + (1 + 1e6) * 1.01e21 < 1.02e27 and |p'| <=
        1e15 + 1e6 * 1.02e27 < 1.03e33; with nesterov (dampening 0) |b'| < 2.02e21, |n| <
        1.01e21 + 1e6 * 2.02e21 < 2.03e27 and |p'| < 2.04e33. Every intermediate is a term
        of these sums, so below 2.1e33: a factor 1.6e5 under float32's limit, room for the
        roundings (1 + 2**-24 each) and for a measured sum of squares that underestimates
        its array by a factor up to 1e10 (the results scale with the inputs' magnitudes, the
        square root of that). Hence every result is finite.

        The bound: Minkowski's inequality line by line, ||x|| = sqrt(sum of squares), S
        bounding ||p||^2 and ||b||^2, G = ||g||^2: ||d|| <= sqrt(G) + wd sqrt(S); ||b'|| <=
        m sqrt(S) + max(1, |1 - dampening|) ||d||; ||n|| <= ||d|| + m ||b'|| (nesterov) or
        ||b'||; ||p'|| <= sqrt(S) + lr ||n||; a rounded operation scales a norm by at most
        1 + 2**-24 (at most 9 in a row: ``ROUNDING``). float16 (largest value 65504) and
        other dtypes get None, as does a subclass with an ``apply`` of its own: measured."""
        if dtype not in _PROVEN_DTYPES or type(self).apply is not SGD.apply:
            return None  # the proof is of SGD.apply's math, in float32 or float64
        x, grad = math.sqrt(squares), math.sqrt(grad_squares)
        d = grad + self.weight_decay * x
        if not self.momentum:
            return ((x + self.lr * d) * ROUNDING) ** 2
        b = self.momentum * x + max(1.0, abs(1.0 - self.dampening)) * d
        n = d + self.momentum * b if self.nesterov else b
        return (max(x + self.lr * n, b) * ROUNDING) ** 2

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        t = param.dtype.type
        tmp = scratch(param)
        d_p = _decayed(self.lr, self.weight_decay, False, param, grad)
        if self.momentum:
            buf = state["momentum_buffer"]
            if buf is None:
                buf = state["momentum_buffer"] = np.array(d_p, dtype=param.dtype, copy=True)
            else:
                buf *= t(self.momentum)
                if self.dampening:
                    np.multiply(d_p, t(1 - self.dampening), out=tmp)
                    buf += tmp
                else:  # times 1.0 is exact: skip the temporary
                    buf += d_p
            if self.nesterov:  # d_p + buf * momentum
                np.multiply(buf, t(self.momentum), out=tmp)
                d_p = np.add(d_p, tmp, out=tmp)
            else:
                d_p = buf
        np.multiply(d_p, t(self.lr), out=tmp)
        param -= tmp


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
        grad = _decayed(self.lr, self.weight_decay, self.decoupled, param, grad)
        state["step"] += 1
        step = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # One scratch array serves every intermediate (same operations, same rounding order as
        # the plain expressions, without their four temporaries).
        tmp = scratch(param)  # an array even for a 0-d variable (a ufunc gives a scalar)
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
        grad = _decayed(self.lr, self.weight_decay, False, param, grad)
        state["step"] += 1
        clr = self.lr / (1 + (state["step"] - 1) * self.lr_decay)
        acc, tmp = state["sum"], scratch(param)
        np.multiply(grad, grad, out=tmp)
        acc += tmp
        np.sqrt(acc, out=tmp)
        tmp += t(self.eps)
        np.divide(grad, tmp, out=tmp)
        tmp *= t(clr)
        param -= tmp


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
        grad = _decayed(self.lr, self.weight_decay, False, param, grad)
        state["step"] += 1
        square_avg = state["square_avg"]
        tmp = scratch(param)
        square_avg *= t(self.alpha)
        np.multiply(grad, t(1 - self.alpha), out=tmp)  # addcmul: value * grad * grad
        tmp *= grad
        square_avg += tmp
        avg = scratch(param, 2)
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
        tmp, std, delta = scratch(param), scratch(param, 2), scratch(param, 3)
        _average_squares(square_avg, grad, self.rho, tmp)
        np.add(square_avg, t(self.eps), out=std)
        np.sqrt(std, out=std)
        np.add(acc_delta, t(self.eps), out=delta)
        np.sqrt(delta, out=delta)
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
        tmp = scratch(param)
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
        tmp, denom = scratch(param), scratch(param, 2)
        _lerp(state["exp_avg"], grad, t(1 - self.beta1), tmp)
        _average_squares(state["exp_avg_sq"], grad, self.beta2, tmp)
        np.divide(state["exp_avg_sq"], t(1 - self.beta2**step), out=denom)
        np.sqrt(denom, out=denom)
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
        tmp, update = scratch(param), scratch(param, 2)
        _lerp(state["exp_avg"], grad, t(1 - self.beta1), tmp)
        _average_squares(state["exp_avg_sq"], grad, self.beta2, tmp)
        bias2 = 1 - self.beta2**step
        np.divide(state["exp_avg"], t(1 - self.beta1**step), out=update)
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
    weight_decay`` in place; else it is added to the (returned) gradient, held in the
    thread's second scratch buffer (``scratch(param, 1)``)."""
    if weight_decay and decoupled:
        param *= param.dtype.type(1 - lr * weight_decay)
    elif weight_decay:
        out = scratch(param, 1)
        np.multiply(param, param.dtype.type(weight_decay), out=out)
        return np.add(grad, out, out=out)
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


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray)


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta, Adamax, NAdam, RAdam)
}
