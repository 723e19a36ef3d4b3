"""The shared-token check: a server interceptor that turns away calls without the right token."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import grpc

from pswire.security import TOKEN_HEADER, TOKEN_SCHEME, check_token

log = logging.getLogger(__name__)

# Health checks stay open: orchestrators (Kubernetes probes, grpc_health_probe, psctl local)
# probe without the job's secret, and SERVING/NOT_SERVING reveals nothing about the model.
# Everything else, the ParameterServer service included, needs the token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization: Bearer <token>`` header is missing or wrong.

    A rejected call gets UNAUTHENTICATED before its handler runs, so it reads nothing from the
    request stream and changes nothing. Tokens are compared in constant time.
    """

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_PREFIXES) -> None:
        self._expected = (TOKEN_SCHEME + check_token(token)).encode("ascii")
        self._open = open_prefixes

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(self._open):
            return continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata)
        if problem is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED either way
        return _refusing(handler, method, problem)

    def _problem(self, metadata: Any) -> str | None:
        """Why the call's credentials fail, or None when they pass."""
        values = [v for k, v in (metadata or ()) if k == TOKEN_HEADER]
        if not values:
            return (
                "this server requires a token: pass token=... to psworker.connect, "
                "or set $PS_TOKEN / $PS_TOKEN_FILE"
            )
        given = values[0]
        given_bytes = given.encode("utf-8", "replace") if isinstance(given, str) else bytes(given)
        # compare_digest on every call, whatever the length: timing must not leak the token.
        if len(values) != 1 or not hmac.compare_digest(given_bytes, self._expected):
            return "the token this call carries is not this server's token"
        return None


def _refusing(handler: grpc.RpcMethodHandler, method: str, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        log.warning("refused %s from %s: %s", method, context.peer(), problem)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {problem}")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
