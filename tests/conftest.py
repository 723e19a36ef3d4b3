"""Shared fixtures: in-process shard servers on port 0, stopped after each test; the process
environment restored after each test (code under test may export PS_* variables)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    # psworker run exports TF_CONFIG and PS_* for its entry point; connect() reads them, so a
    # test that runs it must not leave them to the tests after it.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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
