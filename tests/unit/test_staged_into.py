"""psworker/flight_link.py ``StagedInto``: a streamed step's reply read during backward waits in
staging arrays, reaches the parameters only once backward is over, and is ``placed`` only once
it is there."""

from __future__ import annotations

import numpy as np

from psworker.flight_link import StagedInto


def arrive(into: StagedInto, name: str, value: float) -> np.ndarray:
    """The reading thread's part for one tensor: decoded where ``get`` says, then complete."""
    where = into.get(name)
    where[...] = value
    into.completed(name, where)
    return where


def make() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], StagedInto, list[str]]:
    params = {"a": np.zeros(4, np.float32), "b": np.zeros((2, 3), np.float32)}
    staging: dict[str, np.ndarray] = {}
    told: list[str] = []
    return params, staging, StagedInto(params, staging, told.append), told


def test_a_tensor_arriving_during_backward_waits_aside_until_released_and_copied() -> None:
    params, staging, into, told = make()
    where = arrive(into, "a", 1.0)
    assert not np.may_share_memory(where, params["a"]) and staging["a"] is where
    into.placed("a")  # the reply told of it before backward ended
    assert (params["a"] == 0).all() and told == []
    into.release()  # backward is over; the training thread copies nothing
    assert (params["a"] == 0).all() and told == []
    into.copy_staged()  # the stream's thread, after its last write
    assert (params["a"] == 1).all() and told == ["a"]
    into.copy_staged()
    assert told == ["a"]  # told once


def test_after_release_tensors_go_straight_to_the_parameters() -> None:
    params, _, into, told = make()
    into.release()
    where = arrive(into, "b", 2.0)
    assert np.shares_memory(where, params["b"])
    into.placed("b")
    assert told == ["b"]


def test_a_staged_tensor_placed_after_release_is_copied_before_it_is_told() -> None:
    params, _, into, told = make()
    arrive(into, "a", 3.0)
    into.release()
    into.placed("a")  # the trailer came before the stream's thread copied it
    assert (params["a"] == 3).all() and told == ["a"]
    into.copy_staged()
    assert told == ["a"]


def test_a_tensor_completing_after_release_is_copied_at_once() -> None:
    params, _, into, told = make()
    where = into.get("a")  # begun during backward
    into.release()
    where[...] = 4.0
    into.completed("a", where)
    assert (params["a"] == 4).all()
    into.placed("a")
    assert told == ["a"]


def test_what_cannot_be_staged_or_was_decoded_elsewhere_is_left_to_the_caller() -> None:
    params, _, into, told = make()
    params["a"].flags.writeable = False
    assert into.get("a") is params["a"]  # not decoded in place at all: nothing staged
    assert into.get("missing") is None
    into.get("b")
    elsewhere = np.full((2, 3), 5.0, np.float32)  # another wire dtype: the assembler's own
    into.completed("b", elsewhere)
    into.release()
    into.copy_staged()
    assert (params["b"] == 0).all()
    into.placed("b")
    assert told == ["b"]


def test_a_parameter_that_is_not_c_ordered_is_staged_after_release_too() -> None:
    """A conv weight in channels_last: no reply decodes into it, so it is staged and copied
    (was: decoded elsewhere, never copied in, and the step's weight lost)."""
    params = {"w": np.zeros((3, 4), np.float32).T}  # strided, as channels_last
    told: list[str] = []
    into = StagedInto(params, {}, told.append)
    into.release()
    where = arrive(into, "w", 6.0)
    assert where.flags.c_contiguous and not np.shares_memory(where, params["w"])
    assert (params["w"] == 6).all()
    into.placed("w")
    assert told == ["w"]
