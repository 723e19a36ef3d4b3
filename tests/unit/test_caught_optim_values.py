"""Optimizer details a mutation run (make mutate) found untested: a step's replacement
hyper-parameters (``with_values``: what its errors say), RMSprop's ranges and step count, and
the slot layout SGD's momentum decides."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pscore.optim import SGD, RMSprop
from pscore.optspec import with_values
from pswire.errors import ConfigError, InvalidRequestError


def test_a_bad_replacement_value_names_the_optimizer_and_only_a_given_place() -> None:
    with pytest.raises(InvalidRequestError) as bare:
        with_values(SGD(lr=0.1), {"lr": -1.0})
    assert str(bare.value).startswith("optimizer 'sgd': invalid lr: -1.0")
    with pytest.raises(InvalidRequestError) as placed:
        with_values(SGD(lr=0.1), {"lr": -1.0}, "parameter group 1")
    assert str(placed.value).startswith("parameter group 1: optimizer 'sgd': invalid lr")


def test_switching_momentum_on_mid_job_is_refused_naming_the_change() -> None:
    base = SGD(lr=0.1)
    message = (
        "optimizer 'sgd': {'momentum': 0.9} would change which optimizer state exists (was "
        f"{base.params()}); that is fixed when the job starts"
    )
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        with_values(base, {"lr": 0.1, "momentum": 0.9})
    assert with_values(base, {"lr": 0.5}).lr == 0.5
    assert SGD(lr=0.1, momentum=0.9).layout() == (True,)
    assert SGD(lr=0.1).layout() == (False,)


@pytest.mark.parametrize("name", ["lr", "alpha", "eps", "weight_decay", "momentum"])
def test_rmsprop_refuses_a_negative_value_of_each_hyper_parameter(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"invalid {name}: -1\.0"):
        RMSprop(**{name: -1.0})
    assert RMSprop(**{name: 0.5}) is not None  # within range: taken


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rmsprop_counts_its_steps_from_zero_as_torch_does(momentum: float) -> None:
    opt = RMSprop(lr=0.01, momentum=momentum)
    param = np.ones(3, np.float32)
    state = opt.make_state(param)
    assert state["step"] == 0
    assert ("momentum_buffer" in state) == (momentum > 0)
    for _ in range(3):
        opt.apply(param, np.full(3, 0.5, np.float32), state)
    assert state["step"] == 3
