"""A push on the wire: the worker's encoders and the shard's decoders, side by side.

A push is a header ``(worker_id, step, incarnation)`` with the step's ``StepOptions``
(hyper-parameters that differ from the job's, a GradScaler's skip) and one tensor per piece;
a table's gradient carries its row ids beside its rows. ``Push`` streams them (header first, then
chunks); ``PushPull`` sends every tensor whole in one message.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from pscore.job import Grads
from pscore.optspec import NO_OPTIONS, StepOptions
from pscore.tables import RowSparse
from pswire import stepmsg
from pswire.codec import ChunkAssembler
from pswire.errors import InvalidRequestError
from pswire.proto import ps_pb2
from pswire.wiremsg import encode_chunk_messages, piece_parts

# -- worker side -------------------------------------------------------------------------------


def push_stream(
    worker_id: int,
    step: int,
    pieces: Mapping[str, np.ndarray | RowSparse],
    chunk_bytes: int,
    incarnation: str | None = None,
    session: str = "",
    options: StepOptions | None = None,
) -> Iterator[bytes | ps_pb2.PushRequest]:
    """A Push request stream: the header, then every piece as chunks (a table's rows with
    their ids).

    A uint16 piece is a gradient compressed to bfloat16 (no gradient is an integer).
    """
    # A protobuf message or bytes alike: stubs.as_bytes serializes whichever it gets.
    header = push_header(worker_id, step, incarnation, options, session)
    yield ps_pb2.PushRequest(header=header)
    for key, piece in pieces.items():
        array, ids, bf16 = piece_parts(piece)
        yield from encode_chunk_messages(key, array, 2, chunk_bytes, bfloat16=bf16, indices=ids)


def push_pull_request(
    worker_id: int,
    step: int,
    pieces: Mapping[str, np.ndarray | RowSparse],
    incarnation: str | None = None,
    session: str = "",
    options: StepOptions | None = None,
) -> ps_pb2.PushPullRequest:
    """A PushPullRequest object (for the unary PushPull): the header and every piece whole."""
    header = push_header(worker_id, step, incarnation, options, session)
    return stepmsg.request_message(header, pieces, (), 0)


def push_header(
    worker_id: int,
    step: int,
    incarnation: str | None,
    options: StepOptions | None,
    session: str = "",
) -> ps_pb2.PushHeader:
    """A PushHeader, with ``options`` (hyper-parameter values, skip) when given."""
    header = ps_pb2.PushHeader(
        worker_id=worker_id, step=step, incarnation=incarnation or "", session=session
    )
    if options is not None:
        header.skip = options.skip
        for group, params in sorted(options.values.items()):
            if params:
                header.values.add(group=group, params=dict(params))
    return header


# -- shard side --------------------------------------------------------------------------------


def read_stream(requests: Iterable[Any], assembler: ChunkAssembler, rpc: str) -> Any:
    """Reads a header-then-chunks stream (Init, Push); returns the header, every chunk fed to
    ``assembler``.

    Raises:
        InvalidRequestError: no header, a second one, a chunk before it, an empty message.
    """
    header = None
    for req in requests:
        kind = req.WhichOneof("body")
        if kind == "header":
            if header is not None:
                raise InvalidRequestError(f"{rpc} stream carries a second header")
            header = req.header
        elif kind == "chunk":
            if header is None:
                raise InvalidRequestError(f"{rpc} stream sends a chunk before its header")
            assembler.add(req.chunk)
        else:
            raise InvalidRequestError(f"{rpc} stream carries an empty message")
    if header is None:
        raise InvalidRequestError(f"{rpc} stream ended without a header")
    return header


def assembled_grads(assembler: ChunkAssembler) -> Grads:
    """The gradients a finished assembler holds: a table's rows with their ids as
    ``RowSparse``, dense tensors as arrays.

    Raises:
        InvalidRequestError: an incomplete tensor.
    """
    rows = assembler.indices
    return {k: RowSparse(rows[k], a) if k in rows else a for k, a in assembler.finish().items()}


def push_pull_grads(request: Any, max_bytes: int) -> Grads:
    """The gradients of a PushPullRequest, a protobuf object or one read by hand (every
    tensor whole).

    Raises:
        InvalidRequestError, TooLargeError: malformed or oversized tensors.
    """
    assembler = ChunkAssembler(max_bytes)
    for chunk in request.chunks:
        assembler.add(chunk)
    return assembled_grads(assembler)


def header_options(header: ps_pb2.PushHeader) -> StepOptions:
    """The ``StepOptions`` a PushHeader carries.

    Raises:
        InvalidRequestError: one group given twice.
    """
    if not header.values and not header.skip:
        return NO_OPTIONS
    values: dict[int, dict[str, float]] = {}
    for entry in header.values:
        if entry.group in values:
            raise InvalidRequestError(
                f"push from worker {header.worker_id} gives parameter group {entry.group}'s "
                "hyper-parameters twice"
            )
        values[entry.group] = dict(entry.params)
    return StepOptions(values, header.skip)
