"""A worker's reads of embedding-table rows: what each shard is asked, and where its reply goes.

Whole id arrays with numpy, no Python per row: ids are deduplicated only when some repeat
(a sort tells), split by shard in one pass, and each shard's reply is decoded straight into
the result where its rows are contiguous there (one shard, or a fixed table's sorted ids);
otherwise it is scattered into place once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pscore.tables import as_ids, scatter_rows
from pswire.errors import UnavailableError
from pswire.proto import ps_pb2
from psworker.placement import TableLayout
from psworker.shards import Shards


class RowRead:
    """The rows of ``ids`` of one table, read in one call to every shard holding some."""

    def __init__(self, layout: TableLayout, ids: np.ndarray | Sequence[int]) -> None:
        """Raises:
        InvalidRequestError: ids that are not integers, or outside a fixed table's rows.
        """
        table = layout.table
        self.table = layout.name
        ids = as_ids(layout.name, ids)
        layout.check_ids(ids, "pull")
        self.out = np.empty((len(ids), table.dim), dtype=table.dtype)
        self._inverse: np.ndarray | None = None
        ask, rows, ask_sorted = ids, self.out, False
        if len(ids) > 1 and (ids[1:] > ids[:-1]).all():  # sorted, none twice (np.unique's)
            ask_sorted = True
        elif len(ids) > 1:
            ordered = np.sort(ids)
            if not (ordered[1:] != ordered[:-1]).all():  # some id repeats
                ask, inverse = np.unique(ids, return_inverse=True)
                self._inverse = inverse.reshape(-1)
                rows, ask_sorted = np.empty((len(ask), table.dim), dtype=table.dtype), True
        self._rows = rows
        n = layout.num_shards
        self.ids: list[np.ndarray | None] = [None] * n  # what each shard is asked
        self._into: list[np.ndarray | None] = [None] * n  # contiguous rows of the result
        self._where: list[np.ndarray | None] = [None] * n  # else: their positions in it
        if n == 1:
            self.ids[0], self._into[0] = ask, rows
        elif layout.bounds and ask_sorted:  # a fixed table's shards hold contiguous id ranges
            cuts = np.searchsorted(ask, np.asarray(layout.bounds[1:-1]))
            for shard, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(ask)], strict=True)):
                self.ids[shard], self._into[shard] = ask[a:b], rows[a:b]
        else:
            owner = layout.shard_of(ask)
            for shard in range(n):
                where = np.flatnonzero(owner == shard)
                self.ids[shard], self._where[shard] = ask[where], where

    def query(self, shard: int) -> ps_pb2.RowQuery | None:
        """What ``shard`` is asked (None: none of these rows are there)."""
        ids = self.ids[shard]
        if ids is None or not len(ids):
            return None
        return ps_pb2.RowQuery(table=self.table, ids=ids.astype("<i8", copy=False).tobytes())

    def nbytes(self, shard: int) -> int:
        """The bytes of ``shard``'s reply."""
        ids = self.ids[shard]
        return 0 if ids is None else len(ids) * self.out.itemsize * self.out.shape[1]

    def target(self, shard: int) -> np.ndarray | None:
        """Where ``shard``'s reply can be decoded in place (None: it is scattered)."""
        return self._into[shard]

    def place(self, shard: int, rows: np.ndarray) -> None:
        """Puts ``shard``'s reply into the result (a no-op if it was decoded in place).

        Raises:
            UnavailableError: the reply holds another number of rows than asked.
        """
        ids = self.ids[shard]
        if ids is None or rows.shape != (len(ids), self._rows.shape[1]):
            raise UnavailableError(
                f"shard {shard} answered rows of shape {rows.shape} for the "
                f"{0 if ids is None else len(ids)} rows of table '{self.table}' it was asked"
            )
        into, where = self._into[shard], self._where[shard]
        if into is not None:
            if not np.may_share_memory(into, rows):
                np.copyto(into, rows)
        elif where is not None:
            scatter_rows(self._rows, where, rows)

    def result(self) -> np.ndarray:
        """Every id's row, in the order asked (after every shard's ``place``)."""
        if self._inverse is not None:
            np.take(self._rows, self._inverse, axis=0, out=self.out, mode="clip")
        return self.out


def into_with_rows(
    into: Mapping[str, np.ndarray], reads: Mapping[str, RowRead], shard: int
) -> dict[str, np.ndarray]:
    """``into`` (where a reply's dense tensors are decoded) plus where ``shard``'s table rows
    can be decoded in place."""
    targets = {t: r.target(shard) for t, r in reads.items()}
    return {**into, **{t: a for t, a in targets.items() if a is not None}}


def place_rows(
    reads: Mapping[str, RowRead], shard: int, arrays: dict[str, np.ndarray], where: str
) -> None:
    """Takes ``shard``'s table rows out of its reply ``arrays`` and into their reads.

    Raises:
        UnavailableError: rows asked of the shard missing from its reply (a shard that does
            not know row reads on this call: it predates them).
    """
    for table, read in reads.items():
        if read.query(shard) is None:
            continue
        rows = arrays.pop(table, None)
        if rows is None:
            raise UnavailableError(
                f"{where}: the reply holds no rows of table '{table}' (was the shard built "
                "before PushPull carried row reads? upgrade it)"
            )
        read.place(shard, rows)


class RowReads:
    """Worker ``worker_id``'s reads of embedding-table rows from ``shards``."""

    def __init__(self, shards: Shards, worker_id: int) -> None:
        self.shards = shards
        self.worker_id = worker_id

    def pull_rows(self, table: str, ids: np.ndarray | Sequence[int], step: int) -> np.ndarray:
        """Rows ``ids`` of an embedding table, read at ``step``: see ``PSClient.pull_rows``.

        Raises:
            UnknownVariableError: no such table.
            InvalidRequestError: ids that are not integers, or outside a fixed table's rows.
        """
        read = RowRead(self.shards.layout(table), ids)

        def pull_one(shard: int) -> None:
            query = read.query(shard)
            if query is None:
                return
            request = ps_pb2.PullRequest(worker_id=self.worker_id, step=step, rows=[query])
            target = read.target(shard)
            into = {table: target} if target is not None else None
            read.place(shard, self.shards.links[shard].pull(request, into)[table])

        self.shards.each(pull_one)
        return read.result()

    def reads(self, rows: Mapping[str, np.ndarray | Sequence[int]] | None) -> dict[str, RowRead]:
        """A ``RowRead`` per table of ``rows`` (checked).

        Raises:
            UnknownVariableError, InvalidRequestError: as ``pull_rows``.
        """
        return {t: RowRead(self.shards.layout(t), ids) for t, ids in (rows or {}).items()}
