"""Shared fixtures: in-process shard servers on port 0, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard


@pytest.fixture
def shards() -> Iterator[Callable[..., list[RunningServer]]]:
    """Factory: ``shards(n, limits=...)`` starts n shard servers on 127.0.0.1 port 0."""
    started: list[RunningServer] = []

    def make(n: int = 1, limits: Limits | None = None) -> list[RunningServer]:
        servers = [start_server(Shard(limits)) for _ in range(n)]
        started.extend(servers)
        return servers

    yield make
    for server in started:
        server.stop(grace=0.5)
