"""Mapping between PSError and gRPC status, applied once around every RPC on each end."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from pswire.errors import ERROR_CLASS_KEY, PSError, error_for_status

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, exc: Exception, name: str) -> NoReturn:
    if isinstance(exc, PSError):
        # The exact class travels too: several share a status code.
        context.set_trailing_metadata(((ERROR_CLASS_KEY, type(exc).__name__),))
        context.abort(exc.code, str(exc))
    log.error("unexpected error in %s", name, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}: {type(exc).__name__}")
    raise AssertionError("unreachable")  # context.abort always raises


def rpc_errors(method: F) -> F:
    """Servicer decorator: PSError -> its status; anything else -> INTERNAL, traceback logged.

    Works for unary and streaming-response methods alike. The servicer methods never call
    ``context.abort`` themselves; they raise, and this is the one place that maps.
    """
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            failure: Exception | None = None
            try:
                yield from method(self, request, context)
            except Exception as exc:
                failure = exc
            if failure is not None:
                _abort(context, failure, name)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            failure = exc
        _abort(context, failure, name)

    return wrapper  # type: ignore[return-value]


def from_rpc_error(exc: grpc.RpcError, where: str = "") -> PSError:
    """Client side: the PSError subclass for a failed call, its code on ``.code``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    prefix = f"{where}: " if where else ""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    named = dict(metadata or ()).get(ERROR_CLASS_KEY, "")
    return error_for_status(code.name, f"{prefix}{details}", str(named))
