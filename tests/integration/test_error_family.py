"""Every failure a user meets is a PSError: configuration mistakes and closed clients too,
each still the built-in exception it used to be."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import psworker
from psserver.server import RunningServer
from psworker.ring.ring import RingServer

MODEL = {"w": np.zeros(3, np.float32)}
GRAD = {"w": np.ones(3, np.float32)}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PS_MODE", "PS_STALENESS", "TF_CONFIG", "PS_TLS_CA", "PS_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def test_mode_typo_is_a_config_error_naming_the_modes() -> None:
    with pytest.raises(psworker.ConfigError) as info:
        psworker.connect(["127.0.0.1:7001"], worker_id=0, num_workers=1, mode="snyc")
    assert isinstance(info.value, ValueError)
    assert "mode='snyc' is not a mode" in str(info.value)
    assert "'allreduce'" in str(info.value) and "'local'" in str(info.value)


def test_env_typos_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_MODE", "asynk")
    with pytest.raises(psworker.ConfigError, match=r"\$PS_MODE='asynk' is not a mode"):
        psworker.connect(["127.0.0.1:7001"], worker_id=0, num_workers=1)
    monkeypatch.setenv("PS_MODE", "ssp")
    monkeypatch.setenv("PS_STALENESS", "two")
    with pytest.raises(psworker.ConfigError, match=r"\$PS_STALENESS='two'"):
        psworker.connect(["127.0.0.1:7001"], worker_id=0, num_workers=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "bogus"}, "mode must be one of"),
        ({"worker_id": 3}, "worker_id 3 must be in [0, 2)"),
        ({"compression": "zip"}, "compression must be one of"),
    ],
)
def test_client_settings_are_config_errors(kwargs: dict[str, Any], message: str) -> None:
    settings = {"worker_id": 0, "num_workers": 2, **kwargs}
    with pytest.raises(psworker.ConfigError) as info:
        psworker.ClientSettings(addresses=("127.0.0.1:7001",), **settings)
    assert isinstance(info.value, ValueError) and message in str(info.value)


def test_bad_optimizer_and_table_settings_are_config_errors() -> None:
    with pytest.raises(psworker.ConfigError, match="invalid lr: -1"):
        psworker.SGD(lr=-1)
    with pytest.raises(psworker.ConfigError, match="dim must be >= 1"):
        psworker.Table(10, 0)


ClientCall = Callable[[psworker.Client], object]
CALLS: dict[str, ClientCall] = {
    "init": lambda c: c.init(MODEL, psworker.SGD(lr=0.1)),
    "pull": lambda c: c.pull(),
    "push": lambda c: c.push(GRAD),
    "push_pull": lambda c: c.push_pull(GRAD),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("num_shards", [1, 2])
def test_closed_ps_client_raises_client_closed(
    shards: Callable[..., list[RunningServer]], call: str, num_shards: int
) -> None:
    servers = shards(num_shards)
    client = psworker.connect([s.address for s in servers], worker_id=0, num_workers=1)
    client.init(MODEL, psworker.SGD(lr=0.1))
    client.close()
    with pytest.raises(psworker.ClientClosedError, match="client is closed") as info:
        CALLS[call](client)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_closed_local_client_raises_client_closed(call: str) -> None:
    with psworker.connect(mode="local") as client:
        client.init(MODEL, psworker.SGD(lr=0.1))
    with pytest.raises(psworker.ClientClosedError):
        CALLS[call](client)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_closed_allreduce_client_raises_client_closed(call: str) -> None:
    server = RingServer("127.0.0.1:0")
    client = psworker.connect([server.address], worker_id=0, mode="allreduce", server=server)
    client.init(MODEL, psworker.SGD(lr=0.1))
    client.close()
    with pytest.raises(psworker.ClientClosedError):
        CALLS[call](client)
