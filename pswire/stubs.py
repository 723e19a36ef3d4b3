"""The ParameterServer stub and service registration, tensor streams in hand-coded messages.

The generated code would serialize Push/Init requests and Pull responses through protobuf
objects; here those messages are bytes built by ``pswire.wiremsg.encode_chunk_messages`` and
read by ``parse_chunk`` (same wire format, fewer copies). Every other RPC is the generated code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from pswire import stepmsg
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.wiremsg import WireChunk, parse_chunk, parse_message

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
_LEN = 2


def as_bytes(message: Any) -> bytes:
    """A serializer that passes pre-encoded messages through and serializes protobuf ones."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class StreamRequest:
    """A parsed Init or Push request: its header, or a chunk whose data is not copied."""

    __slots__ = ("chunk", "header", "kind")

    def __init__(self) -> None:
        self.kind: str | None = None
        self.header: Any = None
        self.chunk: WireChunk | None = None

    def WhichOneof(self, group: str) -> str | None:
        return self.kind


class PullReply:
    """A parsed PullResponse."""

    __slots__ = ("chunk", "clock", "skipped")

    def __init__(self) -> None:
        self.chunk: WireChunk = WireChunk()  # empty in the one ``skipped`` message
        self.clock = 0
        self.skipped = False


def stream_request_parser(header_type: Any) -> Callable[[bytes], StreamRequest]:
    """Parses ``{header = 1 | chunk = 2}`` stream messages (InitRequest, PushRequest).

    Raises (from the parser):
        ValueError, protobuf's DecodeError: malformed bytes.
    """

    def parse(data: bytes) -> StreamRequest:
        request = StreamRequest()
        for field, wire, value in parse_message(data):
            if field not in (1, 2):
                continue  # unknown fields are ignored, as protobuf does
            if wire != _LEN or not isinstance(value, memoryview):
                raise ValueError(f"field {field} has wire type {wire}")
            # A oneof keeps the last member set, as protobuf does.
            if field == 1:
                request.kind, request.header = "header", header_type.FromString(bytes(value))
            else:
                request.kind, request.chunk = "chunk", parse_chunk(value)
        return request

    return parse


def parse_pull_reply(data: bytes) -> PullReply:
    """Parses a PullResponse ``{chunk = 1, clock = 2, skipped = 3}``.

    Raises:
        ValueError: malformed bytes.
    """
    reply = PullReply()
    for field, wire, value in parse_message(data):
        if field == 1:
            if not isinstance(value, memoryview):
                raise ValueError(f"PullResponse.chunk has wire type {wire}")
            reply.chunk = parse_chunk(value)
        elif field == 2:
            if not isinstance(value, int):
                raise ValueError(f"PullResponse.clock has wire type {wire}")
            reply.clock = value
        elif field == 3:
            reply.skipped = bool(value)
    return reply


class ParameterServerStub(ps_pb2_grpc.ParameterServerStub):
    """The generated stub with Init, Push and Pull carrying pre-encoded / lazily parsed data.

    ``Init``/``Push`` take an iterator of bytes (or protobuf messages); ``Pull`` yields
    ``PullReply`` objects whose chunk data views the received bytes. ``PushPullStream`` takes
    and gives ``pswire.stepmsg`` messages (protobuf objects when small, bytes when large);
    the unary ``PushPull`` is the generated one.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)  # type: ignore[call-arg]  # the .pyi types it generically
        self.Init = channel.stream_unary(
            f"/{SERVICE}/Init",
            request_serializer=as_bytes,
            response_deserializer=ps_pb2.InitResponse.FromString,
        )
        self.Push = channel.stream_unary(
            f"/{SERVICE}/Push",
            request_serializer=as_bytes,
            response_deserializer=ps_pb2.PushResponse.FromString,
        )
        self.Pull = channel.unary_stream(
            f"/{SERVICE}/Pull",
            request_serializer=ps_pb2.PullRequest.SerializeToString,
            response_deserializer=parse_pull_reply,
        )
        self.PullState = channel.unary_stream(
            f"/{SERVICE}/PullState",
            request_serializer=ps_pb2.PullStateRequest.SerializeToString,
            response_deserializer=parse_pull_reply,
        )
        self.LoadState = channel.stream_unary(
            f"/{SERVICE}/LoadState",
            request_serializer=as_bytes,
            response_deserializer=ps_pb2.LoadStateResponse.FromString,
        )
        self.PushPullStream = channel.stream_stream(
            f"/{SERVICE}/PushPullStream",
            request_serializer=as_bytes,
            response_deserializer=stepmsg.parse_reply,
        )


def add_servicer(
    servicer: ps_pb2_grpc.ParameterServerServicer,
    server: grpc.Server,
    wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] | None = None,
) -> None:
    """Registers ``servicer`` like the generated function, with the hand-coded tensor streams.

    ``wrap(method path, handler)``, if given, replaces each method's handler once, here.

    The servicer's ``Init``/``Push``/``LoadState`` receive ``StreamRequest`` objects; its
    ``Pull``/``PullState`` may yield
    bytes (pre-encoded PullResponses) or protobuf messages.
    The unary RPCs are as generated: ``XRequest`` in, ``XResponse`` out.
    """
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=getattr(ps_pb2, f"{name}Request").FromString,
            response_serializer=getattr(ps_pb2, f"{name}Response").SerializeToString,
        )
        for name in (
            "RegisterWorker",
            "Heartbeat",
            "Status",
            "Checkpoint",
            "Leave",
            "Join",
            "ListMembers",
        )
    }
    # A step's reply is a protobuf object when small, hand-built bytes when large (stepmsg).
    handlers["PushPull"] = grpc.unary_unary_rpc_method_handler(
        servicer.PushPull,
        request_deserializer=ps_pb2.PushPullRequest.FromString,
        response_serializer=as_bytes,
    )
    handlers["PushPullStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.PushPullStream,
        request_deserializer=stepmsg.parse_request,
        response_serializer=as_bytes,
    )
    handlers["Init"] = grpc.stream_unary_rpc_method_handler(
        servicer.Init,
        request_deserializer=stream_request_parser(ps_pb2.InitHeader),
        response_serializer=ps_pb2.InitResponse.SerializeToString,
    )
    handlers["Push"] = grpc.stream_unary_rpc_method_handler(
        servicer.Push,
        request_deserializer=stream_request_parser(ps_pb2.PushHeader),
        response_serializer=ps_pb2.PushResponse.SerializeToString,
    )
    handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
        servicer.Pull,
        request_deserializer=ps_pb2.PullRequest.FromString,
        response_serializer=as_bytes,
    )
    handlers["PullState"] = grpc.unary_stream_rpc_method_handler(
        servicer.PullState,
        request_deserializer=ps_pb2.PullStateRequest.FromString,
        response_serializer=as_bytes,
    )
    handlers["LoadState"] = grpc.stream_unary_rpc_method_handler(
        servicer.LoadState,
        request_deserializer=stream_request_parser(ps_pb2.LoadStateHeader),
        response_serializer=ps_pb2.LoadStateResponse.SerializeToString,
    )
    if wrap is not None:
        handlers = {name: wrap(f"/{SERVICE}/{name}", h) for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
