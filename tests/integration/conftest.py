"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from faults import FaultPlan
from link_cluster import Cluster

from psworker.session import GRPC_BELOW_BYTES


@pytest.fixture(params=["flight", "grpc-small"])
def data_plane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: tensors of every size on the Flight data port, and with the default
    size rule (these tests' small steps then travel on grpcio)."""
    if request.param == "flight":
        monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "0")
    else:
        monkeypatch.delenv("PS_GRPC_BELOW_BYTES", raising=False)
    return str(request.param)


@pytest.fixture
def cluster(data_plane: str) -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    class Made(Cluster):
        def __init__(self, *plans: FaultPlan, **options: Any) -> None:
            below = 0 if data_plane == "flight" else GRPC_BELOW_BYTES
            super().__init__(*plans, grpc_below_bytes=below, **options)
            # The transport the steps of this test take (its small steps: grpcio by default).
            assert self.link.transport().name == ("flight" if below == 0 else "grpc"), data_plane
            made.append(self)

    yield Made
    for c in made:
        c.close()
