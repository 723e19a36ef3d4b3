"""``Shards``: one worker's connections to its job's shards, the part every other part of the
client is handed: the links (one per shard, each recovering its shard by itself), the fan-out
of a call over them, and where the model lies on them once ``init`` placed it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from pswire.errors import ClientClosedError, NotInitializedError, not_in_model
from pswire.security import ClientSecurity
from psworker.fanout import FanOut
from psworker.link import ShardLink
from psworker.placement import ShardMap, TableLayout
from psworker.session import JobIdentity
from psworker.settings import ClientSettings

T = TypeVar("T")


class Shards:
    """The links to every shard of ``settings.addresses``, a call fanned out over them, and
    the model's placement (``shard_map``, ``tables``: None and empty until ``place``)."""

    def __init__(self, settings: ClientSettings, session: str, identity: JobIdentity) -> None:
        self.addresses = list(settings.addresses)
        self.worker_id = settings.worker_id
        self.timeout = settings.timeout
        self.security: ClientSecurity = settings.security
        self._channels = [self.security.channel(a) for a in self.addresses]
        channels = [grpc.intercept_channel(c, *settings.interceptors) for c in self._channels]
        config = settings.link_config(session)
        self.links = [
            ShardLink(i, a, channel, config, identity, self.security)
            for i, (a, channel) in enumerate(zip(self.addresses, channels, strict=True))
        ]
        self._fan = FanOut(len(self.addresses))
        self.shard_map: ShardMap | None = None
        self.tables: dict[str, TableLayout] = {}
        self.closed = False

    def __len__(self) -> int:
        return len(self.links)

    def place(self, shard_map: ShardMap, tables: dict[str, TableLayout]) -> None:
        """Records where the model lies, once every shard agreed on it (``init``)."""
        self.shard_map, self.tables = shard_map, tables

    def require_open(self) -> None:
        """Raises:
        ClientClosedError: ``close()`` was called.
        """
        if self.closed:
            raise ClientClosedError(f"worker {self.worker_id}'s client is closed: connect again")

    def require_map(self) -> ShardMap:
        """The shard map.

        Raises:
            ClientClosedError: the client is closed.
            NotInitializedError: ``init`` has not placed the model yet.
        """
        self.require_open()
        if self.shard_map is None:
            raise NotInitializedError("call client.init(variables, optimizer) before pull or push")
        return self.shard_map

    def layout(self, table: str) -> TableLayout:
        """Where embedding table ``table``'s rows lie.

        Raises:
            UnknownVariableError: no such table.
            NotInitializedError, ClientClosedError: as ``require_map``.
        """
        self.require_map()
        layout = self.tables.get(table)
        if layout is None:
            raise not_in_model(table, self.tables, "table")
        return layout

    def each(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(shard)`` on every shard in parallel: the results in shard order.

        Raises:
            ClientClosedError: the client is closed.
            PSError: the first failed shard's error (every call ran to its end).
        """
        self.require_open()
        return self._fan.each(fn)

    def settle(self, fn: Callable[[int], T]) -> tuple[list[T], list[tuple[int, Exception]]]:
        """``fn(shard)`` on every shard, each run to its end: (results, (shard, error) of the
        failed ones); see ``FanOut.settle``."""
        return self._fan.settle(fn)

    def settle_started(
        self, start: Callable[[int], Callable[[], T]]
    ) -> tuple[list[T], list[tuple[int, Exception]]]:
        """``settle`` for calls in two halves (``start(shard)`` sends and returns the wait);
        a shard whose open step call ends early is recovered while the others' replies are
        pending (see ``FanOut.settle_started``)."""
        return self._fan.settle_started(start, self._when_ended)

    def close(self) -> None:
        """Leaves the job if this worker joined it (the model is placed), then closes the
        links and channels; calls afterwards raise ``ClientClosedError``."""
        if self.closed:
            return
        self.closed = True
        # A worker that joined (init) leaves; one whose init failed gives up its claim on its id.
        joined = self.shard_map is not None
        self._fan.settle(lambda shard: self.links[shard].leave(joined))
        self._fan.close()
        for link in self.links:
            link.close()
        for channel in self._channels:
            channel.close()

    def _when_ended(self, shard: int, fn: Callable[[], None]) -> None:
        self.links[shard].steps.when_ended(fn)
