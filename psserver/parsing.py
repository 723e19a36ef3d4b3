"""Requests whose bytes do not parse get INVALID_ARGUMENT instead of grpc's bare INTERNAL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from psserver.handlers import rewrapped
from pswire.errors import InvalidRequestError


class _Malformed:
    """Stands in for a request message that failed to parse; carries why."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def tolerant(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` for ``method``, answering undecodable request bytes with INVALID_ARGUMENT
    and a message naming the method.

    grpc answers a request it cannot deserialize with INTERNAL ("Exception deserializing
    request!") and logs a traceback, which blames the server for the client's bytes. Here the
    deserializer returns a marker instead of raising, and the method sees the marker first: a
    unary call is aborted before the handler runs; in a stream the marker raises
    ``InvalidRequestError`` where the handler reads it, so the handler's one error mapping sends
    it, and the handler's own validation (nothing applied until the stream is whole) keeps the
    shard unchanged.

    Applied once, when the service is registered (``add_servicer(wrap=tolerant)``): a server
    interceptor doing the same ran on every call, a measurable part of a small step.
    """
    if handler.request_deserializer is None:
        return handler
    return _tolerant(handler, method)


def _tolerant(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    assert parse is not None

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a parser may raise
            return _Malformed(
                f"{method}: a request message of {len(data)} bytes does not parse "
                f"({type(exc).__name__}: {exc})"
            )

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return behavior(request, context)

        return run

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(_checked(requests), context)

        return run

    return rewrapped(
        handler,
        lambda kind, behaviour: (unary if kind.startswith("unary") else streaming)(behaviour),
        deserialize,
    )


def _checked(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, _Malformed):
            raise InvalidRequestError(request.message)
        yield request
