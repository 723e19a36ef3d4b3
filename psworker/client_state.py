"""A worker's model-state calls: read every trained variable's optimizer slots from the shards
(joined across split variables), and load values and slots into them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pswire.codec import ChunkAssembler
from pswire.errors import ModelMismatchError, not_in_model
from pswire.optstate import split_state, state_arrays
from pswire.proto import ps_pb2
from pswire.write import encode_chunk_messages
from psworker.shards import Shards

Slots = dict[str, dict[str, Any]]  # variable -> slot -> array or count


class ModelState:
    """Worker ``worker_id``'s reads and loads of the model's state on ``shards``, sent in
    parts of at most ``chunk_bytes``."""

    def __init__(self, shards: Shards, worker_id: int, chunk_bytes: int) -> None:
        self.shards = shards
        self.worker_id = worker_id
        self.chunk_bytes = chunk_bytes

    def optimizer_state(self) -> Slots:
        """Every trained variable's optimizer slots, a split variable's pieces joined (see
        ``PSClient.optimizer_state``).

        Raises:
            PSError: a shard failed to answer.
        """
        shard_map = self.shards.require_map()

        def one(shard: int) -> dict[str, np.ndarray]:
            link = self.shards.links[shard]
            request = ps_pb2.PullStateRequest(worker_id=self.worker_id)

            def run(stub: Any) -> dict[str, np.ndarray]:
                assembler = ChunkAssembler()
                for reply in stub.PullState(request, timeout=link.timeout):
                    assembler.add(reply.chunk)
                return assembler.finish()

            return link.call("PullState", run)

        merged: dict[str, np.ndarray] = {}
        for shard, part in enumerate(self.shards.each(one)):
            for key, array in part.items():
                if key in merged:  # a piece lives on one shard: never merge one over another
                    raise ModelMismatchError(
                        f"shard {shard} and another shard both hold state '{key}': the shards "
                        "hold another model's plan"
                    )
                merged[key] = array
        _, by_piece = split_state(merged)
        out: Slots = {}
        for var in shard_map.variables:
            parts = shard_map.pieces_of(var.name)
            if parts[0].key not in by_piece:
                continue  # a buffer: no optimizer state
            state: dict[str, Any] = {}
            for slot, first in by_piece[parts[0].key].items():
                found = [by_piece.get(p.key, {}).get(slot) for p in parts]
                pieces = [p for p in found if p is not None]
                if len(pieces) < len(parts):
                    continue  # made on some pieces only (never happens: pieces step together)
                if first.dtype.kind in "iu" and first.ndim == 0:
                    state[slot] = int(first)  # a count: the same on every piece
                else:
                    state[slot] = first if len(parts) == 1 else np.concatenate(pieces, axis=0)
            out[var.name] = state
        return out

    def load_state(
        self,
        values: Mapping[str, np.ndarray] | None,
        slots: Mapping[str, Mapping[str, Any]],
        digest: str,
    ) -> None:
        """Worker 0's ``values`` and ``slots`` replace the shards'; the others check
        ``digest`` (see ``PSClient.load_state``).

        Raises:
            ModelMismatchError: this worker loaded another state than worker 0.
            UnknownVariableError, InvalidRequestError: a bad state (the shards changed nothing).
            WaitTimeoutError: worker 0 did not load in time.
        """
        shard_map = self.shards.require_map()
        send = self.worker_id == 0
        value_pieces = shard_map.split(dict(values or {})) if send else []
        slot_pieces: list[Slots] = [{} for _ in self.shards.links]
        for name, state in slots.items() if send else ():
            parts = shard_map.pieces_of(name)
            if not parts:
                raise not_in_model(name, (v.name for v in shard_map.variables))
            for piece in parts:
                slot_pieces[piece.shard][piece.key] = {
                    slot: v[piece.start : piece.stop]
                    if len(parts) > 1 and isinstance(v, np.ndarray)
                    else v
                    for slot, v in state.items()
                }

        def one(shard: int) -> None:
            link = self.shards.links[shard]
            header = ps_pb2.LoadStateHeader(worker_id=self.worker_id, digest=digest)
            header.has_values = send

            def stream() -> Iterator[bytes | ps_pb2.LoadStateRequest]:
                yield ps_pb2.LoadStateRequest(header=header)
                if send:
                    arrays = {**value_pieces[shard], **state_arrays(slot_pieces[shard])}
                    for key, array in arrays.items():
                        yield from encode_chunk_messages(key, array, 2, self.chunk_bytes)

            link.call("LoadState", lambda stub: stub.LoadState(stream(), timeout=link.timeout))

        self.shards.each(one)
