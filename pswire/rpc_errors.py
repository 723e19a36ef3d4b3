"""Mapping between PSError and gRPC status, applied once around every RPC on each end."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn, TypeVar

import grpc

from pswire.errors import ERROR_CLASS_KEY, PSError, error_for_status

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


class _Status(NamedTuple):
    code: grpc.StatusCode
    details: str
    error_class: str  # the PSError class name, for the trailing metadata ("" for none)


def _status_of(exc: Exception, name: str) -> _Status:
    """The status a failed call answers with (an unexpected error's traceback is logged)."""
    if isinstance(exc, grpc.RpcError):
        # Raised by a request stream whose client cancelled or went away: no one to answer.
        log.debug("%s: the caller went away (%s)", name, exc)
        return _Status(grpc.StatusCode.CANCELLED, f"{name}: the call was cancelled", "")
    if isinstance(exc, PSError):
        # The exact class travels too: several share a status code.
        return _Status(exc.code, str(exc), type(exc).__name__)
    log.error("unexpected error in %s", name, exc_info=exc)
    return _Status(grpc.StatusCode.INTERNAL, f"internal error in {name}: {type(exc).__name__}", "")


def _abort(context: grpc.ServicerContext, status: _Status) -> NoReturn:
    if status.error_class:
        context.set_trailing_metadata(((ERROR_CLASS_KEY, status.error_class),))
    context.abort(status.code, status.details)
    raise AssertionError("unreachable")  # context.abort always raises


def rpc_errors(method: F) -> F:
    """Servicer decorator: PSError -> its status; anything else -> INTERNAL, traceback logged.

    Works for unary and streaming-response methods alike. The servicer methods never call
    ``context.abort`` themselves; they raise, and this is the one place that maps. The
    exception is dropped before aborting: kept, its traceback would hold the failed call's
    frames (and the request's arrays) in a reference cycle until the cyclic collector ran.
    """
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            status = None
            try:
                yield from method(self, request, context)
            except Exception as exc:
                status = _status_of(exc, name)
            if status is not None:
                _abort(context, status)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            status = _status_of(exc, name)
        _abort(context, status)

    return wrapper  # type: ignore[return-value]


def from_rpc_error(exc: grpc.RpcError, where: str = "") -> PSError:
    """Client side: the PSError subclass for a failed call, its code on ``.code``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    prefix = f"{where}: " if where else ""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    named = dict(metadata or ()).get(ERROR_CLASS_KEY, "")
    return error_for_status(code.name, f"{prefix}{details}", str(named))
