"""Wire and optimizer details a mutation run (make mutate) found untested: the decoder's
``reserve`` hook, the finite-value check's silence about the overflow it expects, centered
RMSprop's running mean at the weights where torch's lerp changes formula, the message for a
missing optimizer, and which id a table's range check names."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from pscore.checks import all_finite, check_tensor
from pscore.optim import RMSprop
from pscore.optspec import resolve_groups
from pscore.tables import Table
from pswire.codec import ChunkAssembler
from pswire.errors import InvalidRequestError, TooLargeError
from pswire.write import tensor_to_chunks
from psworker.placement import TableLayout

# --- ChunkAssembler's reserve(n) -----------------------------------------------------------


def test_reserve_is_told_each_tensors_bytes_and_can_refuse_one() -> None:
    """Guards the admission hook: a shard's in-flight byte budget hears of every tensor's size
    once, from its first chunk, and a refusal stops the request."""
    told: list[int] = []

    def reserve(nbytes: int) -> None:
        told.append(nbytes)
        if len(told) == 3:
            raise TooLargeError(f"refused {nbytes} bytes")

    assembler = ChunkAssembler(reserve=reserve)
    for chunk in tensor_to_chunks("a", np.zeros((2, 3), np.float32), chunk_bytes=8):
        assembler.add(chunk)
    for chunk in tensor_to_chunks("b", np.zeros(4, np.int64)):
        assembler.add(chunk)
    assert told == [24, 32]  # once per tensor, not per chunk
    assert sorted(assembler.finish()) == ["a", "b"]
    first = next(tensor_to_chunks("c", np.zeros(10, np.float64)))
    with pytest.raises(TooLargeError, match="refused 80 bytes"):
        assembler.add(first)


# --- all_finite's fast path --------------------------------------------------------------

BIG = 1 << 16  # large enough for all_finite's dot-product fast path


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finite_check_is_silent_when_its_dot_product_overflows(dtype: type) -> None:
    """Guards the errstate around all_finite's dot: finite values whose squares overflow are
    valid gradients and must pass without a numpy RuntimeWarning (an error where warnings are
    errors)."""
    huge = np.full(BIG, np.finfo(dtype).max / 2, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all_finite(huge)
        check_tensor("w", (BIG,), np.dtype(dtype).name, huge, "worker 0")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finite_check_is_silent_on_a_signaling_nan(dtype: type) -> None:
    """Guards the errstate around all_finite's dot: a signaling NaN (any bit pattern can
    arrive on the wire) raises 'invalid' in the multiply; it must be refused as non-finite
    without a numpy RuntimeWarning."""
    values = np.ones(BIG, dtype)
    if dtype is np.float32:
        values.view(np.uint32)[7] = 0x7F800001
    else:
        values.view(np.uint64)[7] = 0x7FF0000000000001
    assert np.isnan(values[7])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not all_finite(values)
        with pytest.raises(InvalidRequestError, match="1 non-finite values"):
            check_tensor("w", (BIG,), np.dtype(dtype).name, values, "worker 0")


# --- centered RMSprop's running mean of gradients (torch's lerp_) ---------------------------


def mixed_grads(steps: int) -> list[np.ndarray]:
    """Gradients of very different magnitudes, where lerp's two formulas round differently."""
    rng = np.random.default_rng(7)
    scales = rng.choice([1e-4, 1.0, 1e4], size=(steps, 4096))
    return [(rng.normal(size=4096) * s).astype(np.float32) for s in scales]


@pytest.mark.torch
@pytest.mark.parametrize("alpha", [0.5, 0.0])
def test_centered_rmsprop_grad_avg_matches_torch_bit_for_bit(alpha: float) -> None:
    """Guards _lerp's switch of formula at weight 0.5 (weight = 1 - alpha): at the weights
    0.5 and 1 both formulas are exact in torch's fused and unfused forms alike, so the state
    must equal torch's bit for bit."""
    torch = pytest.importorskip("torch")
    opt = RMSprop(lr=0.01, alpha=alpha, centered=True)
    param = np.random.default_rng(1).normal(size=4096).astype(np.float32)
    state = opt.make_state(param)
    theirs = torch.tensor(param.copy(), requires_grad=True)
    reference = torch.optim.RMSprop([theirs], lr=0.01, alpha=alpha, centered=True)
    for grad in mixed_grads(4):
        opt.apply(param, grad, state)
        theirs.grad = torch.from_numpy(grad.copy())
        reference.step()
    expected = reference.state[theirs]["grad_avg"].numpy()
    assert np.array_equal(state["grad_avg"].view(np.int32), expected.view(np.int32))


def test_centered_rmsprop_with_alpha_zero_keeps_the_last_gradient_exactly() -> None:
    """Guards _lerp at weight 1 (alpha = 0): torch's lerp gives ``end`` exactly there, so the
    running mean is the last gradient, its variance 0, and the step lr * grad / eps."""
    opt = RMSprop(lr=0.01, alpha=0.0, eps=1e-3, centered=True)
    param = np.zeros(2, np.float32)
    state = opt.make_state(param)
    opt.apply(param, np.array([1e8, -3e7], np.float32), state)
    param[:] = 0.0  # the first step moved it far; the second's size is what is checked
    last = np.array([1.0, 0.5], np.float32)
    opt.apply(param, last, state)
    assert state["grad_avg"].tolist() == last.tolist()
    np.testing.assert_allclose(-param, 0.01 * last / 1e-3, rtol=1e-6)


# --- resolve_groups -----------------------------------------------------------------------


def test_no_optimizer_is_refused_saying_what_to_give() -> None:
    """Guards resolve_groups' message for an empty list of optimizers."""
    with pytest.raises(InvalidRequestError) as info:
        resolve_groups([], None, ["w"])
    assert re.search(r"^no optimizer: give one, or one per parameter group$", str(info.value))


# --- TableLayout.check_ids ----------------------------------------------------------------


def test_an_out_of_range_id_is_named_even_after_valid_zeros() -> None:
    """Guards check_ids' bound: id 0 is a valid row, so the error names the first id really
    out of range and counts only those."""
    layout = TableLayout.build("emb", Table(10, 2), 2)
    ids = np.array([0, 3, 0, 12, 9, 0], dtype=np.int64)
    message = "table 'emb': push has id 12, outside [0, 10) (1 ids out of range)"
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        layout.check_ids(ids, "push")
    layout.check_ids(np.array([0, 0, 9]), "pull")  # zeros alone are fine
