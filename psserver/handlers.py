"""A gRPC method handler rebuilt with its behaviour wrapped: what each server-side layer
(parsing, admission, metrics) does to every method, once, at registration or interception."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# The four kinds of method: (request streams?, response streams?) and how to rebuild each.
_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def rewrapped(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(kind, behaviour)`` (kind: one of
    ``unary_unary``, ``unary_stream``, ``stream_unary``, ``stream_stream``), and its request
    deserializer by ``request_deserializer`` when given."""
    kwargs = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    for kind, make in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return make(wrap(kind, behaviour), **kwargs)
    return handler
