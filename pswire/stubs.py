"""The ParameterServer stub and service registration over ``pswire.write``'s messages and
``pswire.read``'s parsers: every tensor-carrying RPC (Init, Push, Pull, PullState, LoadState,
PushPull, PushPullStream) sends bytes and reads with one hand-written parser; the others are
the generated code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.read import parse_pull_reply, parse_reply, parse_request, stream_request_parser

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def as_bytes(message: Any) -> bytes:
    """A serializer that passes pre-encoded messages through and serializes protobuf ones."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class ParameterServerStub(ps_pb2_grpc.ParameterServerStub):
    """The generated stub with every tensor-carrying RPC on hand-written messages.

    ``Init``/``Push``/``LoadState`` take an iterator of bytes (or protobuf messages);
    ``Pull``/``PullState`` yield ``PullReply`` objects whose chunk data views the received
    bytes; ``PushPull`` and ``PushPullStream`` take ``pswire.write.request`` bytes (or a
    protobuf message) and give ``pswire.read.StepReply`` objects.
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
            response_deserializer=parse_reply,
        )
        self.PushPull = channel.unary_unary(
            f"/{SERVICE}/PushPull",
            request_serializer=as_bytes,
            response_deserializer=parse_reply,
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
    # A step's request and reply: pswire.read's parser, pswire.write's bytes.
    handlers["PushPull"] = grpc.unary_unary_rpc_method_handler(
        servicer.PushPull,
        request_deserializer=parse_request,
        response_serializer=as_bytes,
    )
    handlers["PushPullStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.PushPullStream,
        request_deserializer=parse_request,
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
