"""Optimizer state on the wire (PullState, LoadState): each slot a tensor named by its slot
and variable, a count (a step) a 0-d int64 tensor; variables' values under their own keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pswire.errors import InvalidRequestError

SLOT_PREFIX = "slot/"


def slot_name(slot: str, key: str) -> str:
    """The tensor name of variable ``key``'s optimizer slot ``slot`` (slots hold no "/")."""
    return f"{SLOT_PREFIX}{slot}/{key}"


def split_state(
    arrays: Mapping[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """(values by key, slots by key then slot) of decoded state tensors.

    Raises:
        InvalidRequestError: a slot tensor name without a slot or a variable.
    """
    values: dict[str, np.ndarray] = {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        if not name.startswith(SLOT_PREFIX):
            values[name] = array
            continue
        slot, _, key = name[len(SLOT_PREFIX) :].partition("/")
        if not slot or not key:
            raise InvalidRequestError(
                f"state tensor '{name}' should be named '{SLOT_PREFIX}<slot>/<variable>'"
            )
        slots.setdefault(key, {})[slot] = array
    return values, slots


def state_arrays(slots: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Slot tensors by wire name: arrays as they are, counts as 0-d int64 (None: left out)."""
    out = {}
    for key, state in slots.items():
        for slot, value in state.items():
            if value is None:
                continue
            array = value if isinstance(value, np.ndarray) else np.asarray(value, np.int64)
            out[slot_name(slot, key)] = array
    return out
