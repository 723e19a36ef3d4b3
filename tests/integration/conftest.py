"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from faults import FaultPlan
from link_cluster import Cluster

from psworker.session import GRPC_BELOW_BYTES

# Each way a step can travel: record batches on the Flight data port at every size; the
# default size rule (these tests' small steps in one message each way on the data port); and
# grpcio's step stream (a worker told to keep tensors off the data port, or a shard without).
PLANES = {"flight": "flight", "flight-step": "flight-step", "grpc": "grpc"}


@pytest.fixture(params=list(PLANES))
def data_plane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test three times: record batches on the Flight data port at every size, the
    default size rule (small steps in one message each way on the data port), and grpcio."""
    monkeypatch.delenv("PS_GRPC_BELOW_BYTES", raising=False)
    monkeypatch.delenv("PS_DATA_PLANE", raising=False)
    if request.param == "flight":
        monkeypatch.setenv("PS_GRPC_BELOW_BYTES", "0")
    elif request.param == "grpc":
        monkeypatch.setenv("PS_DATA_PLANE", "grpc")
    return str(request.param)


@pytest.fixture
def cluster(data_plane: str) -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    class Made(Cluster):
        def __init__(self, *plans: FaultPlan, **options: Any) -> None:
            below = 0 if data_plane == "flight" else GRPC_BELOW_BYTES
            plane = "grpc" if data_plane == "grpc" else "auto"
            super().__init__(*plans, grpc_below_bytes=below, data_plane=plane, **options)
            # The transport the steps of this test take.
            assert self.link.transport(step=True).name == PLANES[data_plane], data_plane
            made.append(self)

    yield Made
    for c in made:
        c.close()
