"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from faults import FaultPlan
from link_cluster import Cluster


@pytest.fixture
def cluster() -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    class Made(Cluster):
        def __init__(self, *plans: FaultPlan, **options: Any) -> None:
            super().__init__(*plans, **options)
            made.append(self)

    yield Made
    for c in made:
        c.close()
