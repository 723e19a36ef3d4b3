"""TLS, mutual TLS and shared-token settings for both ends, and the channel factory using them."""

from __future__ import annotations

import hmac
import logging
import os
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from pswire.channel import OPTIONS, check_address, insecure_channel
from pswire.errors import ConfigError

# The header both ends use for the token: the HTTP convention, and what
# grpc.access_token_call_credentials sends.
TOKEN_HEADER = "authorization"
TOKEN_SCHEME = "Bearer "
# A token travels as an HTTP/2 header value: printable ASCII, no whitespace, so neither end
# has to guess at trimming or encoding.
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)

log = logging.getLogger(__name__)


def check_token(token: str, source: str = "token") -> str:
    """Returns ``token`` if it can travel as a header value.

    Raises:
        ConfigError: empty, or a character other than printable non-space ASCII; the message
            names ``source`` but never echoes the token.
    """
    if not token:
        raise ConfigError(f"{source} is empty")
    bad = sorted({c for c in token if c not in _TOKEN_CHARS})
    if bad:
        raise ConfigError(
            f"{source} holds {len(bad)} kind(s) of character that cannot travel in a header "
            "(only printable ASCII without spaces is allowed)"
        )
    return token


def read_token_file(path: str | Path) -> str:
    """The token stored in ``path``, without the trailing newline editors add.

    Raises:
        ConfigError: the file cannot be read or holds no valid token.
    """
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read token file {str(path)!r}: {exc}") from exc
    return check_token(text.strip(), f"token file {str(path)!r}")


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc}") from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {str(path)!r} is not a PEM file")
    return data


def _optional_path(value: str | Path | None) -> Path | None:
    return Path(value) if value else None


@dataclass(frozen=True)
class ServerSecurity:
    """A daemon's credentials: ``cert``+``key`` turn on TLS; ``ca`` (with them) demands a client
    certificate signed by it (mutual TLS); ``token`` makes every call but health checks carry it.
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    # Kept out of repr: a logged config must not leak the secret.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if (self.cert is None) != (self.key is None):
            problems.append("--tls-cert and --tls-key go together")
        if self.ca is not None and self.cert is None:
            problems.append("--tls-ca (verify client certificates) needs --tls-cert and --tls-key")
        if self.token is not None:
            try:
                check_token(self.token)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        """The TLS credentials for ``add_secure_port``, read from the PEM files now.

        Raises:
            ConfigError: TLS is off, or a file cannot be read or is not PEM.
        """
        if self.cert is None or self.key is None:
            raise ConfigError("server TLS needs a certificate and a key")
        pair = (_read_pem(self.key, "TLS key"), _read_pem(self.cert, "TLS certificate"))
        ca = _read_pem(self.ca, "TLS CA certificate") if self.ca is not None else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=ca is not None
        )

    def describe(self) -> str:
        """One line for the startup log: what is on, never the secrets."""
        parts = ["mutual TLS" if self.mutual else "TLS" if self.tls else "plaintext"]
        parts.append("token required" if self.token else "no token")
        return ", ".join(parts)


@dataclass(frozen=True)
class ClientSecurity:
    """A client's credentials: ``ca`` verifies the servers (TLS on); ``cert``+``key`` are the
    client certificate for mutual TLS; ``token`` is sent with every call.

    With ``cert`` but no ``ca`` the servers are verified against the system's root CAs.
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    # Kept out of repr: a logged config must not leak the secret.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if (self.cert is None) != (self.key is None):
            problems.append("tls_cert and tls_key go together")
        if self.token is not None:
            try:
                check_token(self.token)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def from_env(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        token: str | None = None,
    ) -> ClientSecurity:
        """Arguments, else ``$PS_TLS_CA``, ``$PS_TLS_CERT``, ``$PS_TLS_KEY``, ``$PS_TOKEN``
        (or a file named by ``$PS_TOKEN_FILE``), else off.

        Raises:
            ConfigError: inconsistent settings or an unreadable token file.
        """
        env = os.environ.get
        if token is None:
            token = env("PS_TOKEN") or None
            if token is None and env("PS_TOKEN_FILE"):
                token = read_token_file(env("PS_TOKEN_FILE", ""))
        return cls(
            ca=_optional_path(ca or env("PS_TLS_CA")),
            cert=_optional_path(cert or env("PS_TLS_CERT")),
            key=_optional_path(key or env("PS_TLS_KEY")),
            token=token,
        )

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def peer_server(self) -> ServerSecurity:
        """The settings for a server this client also runs as a peer (an all-reduce worker's
        ring server): its own certificate, clients verified against the same CA (mutual TLS),
        the same token.

        Raises:
            ConfigError: TLS (a CA) without a certificate and key to serve with.
        """
        if self.ca is not None and self.cert is None:
            raise ConfigError(
                "all-reduce with TLS needs each worker's certificate and key (tls_cert, "
                "tls_key: e.g. psctl certs' server.pem, valid for every worker's host) for its "
                "ring server"
            )
        return ServerSecurity(
            cert=self.cert, key=self.key, ca=self.ca if self.cert else None, token=self.token
        )

    def channel(self, address: str) -> grpc.Channel:
        """A channel to ``host:port`` with these credentials and the project's options.

        Raises:
            ConfigError: a PEM file cannot be read, or the address has no port.
        """
        check_address(address)
        if not self.tls:
            if self.token is None:
                return insecure_channel(address)
            # gRPC refuses call credentials on a plaintext channel (it would leak them), so a
            # token without TLS rides as metadata added by an interceptor: fine on a trusted
            # network, which is the only place a plaintext cluster belongs.
            return grpc.intercept_channel(insecure_channel(address), _TokenInterceptor(self.token))
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca, "TLS CA certificate") if self.ca else None,
            private_key=_read_pem(self.key, "TLS key") if self.key else None,
            certificate_chain=_read_pem(self.cert, "TLS certificate") if self.cert else None,
        )
        if self.token is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(self.token)
            )
        return grpc.secure_channel(address, creds, options=OPTIONS)

    def diagnose(self, address: str, details: str) -> str:
        """What a failed connection to ``address`` most likely means, given grpc's ``details``
        and what this client expects (TLS or not, which CA); "" when nothing more is known."""
        ca = f"tls_ca={str(self.ca)!r}" if self.ca else "the system's root CAs"
        if "Connection refused" in details:
            return "nothing accepts connections there: is the shard running, on that host and port?"
        if "resolving" in details or "Domain name not found" in details:
            return f"the host name in {address!r} does not resolve"
        if "Hostname Verification" in details or "Peer name" in details:
            return (
                "TLS: the shard's certificate does not name this host; make it for the name "
                "you connect to (psctl certs --hosts ...) or connect by a name it has"
            )
        if "CERTIFICATE_VERIFY_FAILED" in details:
            return (
                f"TLS: the shard's certificate is not signed by the CA this client trusts "
                f"({ca}); pass the CA that signed the shard's --tls-cert"
            )
        if self.tls and ("WRONG_VERSION_NUMBER" in details or "handshake failed" in details):
            return (
                f"TLS mismatch: this client expects TLS ({ca}) but the shard answers in "
                "plaintext; start the shard with --tls-cert/--tls-key, or connect without "
                "tls_ca / $PS_TLS_CA"
            )
        if "Socket closed" in details and not self.tls:
            return (
                "TLS mismatch: the shard closed the connection during setup, as a TLS shard "
                "does to a plaintext client (this client has no tls_ca / $PS_TLS_CA); pass "
                "tls_ca= the CA that signed the shard's certificate"
            )
        if "Socket closed" in details:
            return (
                "TLS mismatch: the shard closed the connection during the handshake, as a shard "
                "demanding mutual TLS (--tls-ca) does to a client without a certificate its CA "
                "signed" + (" (this client has no tls_cert / tls_key)" if self.cert is None else "")
            )
        return ""


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call on a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._header = (TOKEN_HEADER, TOKEN_SCHEME + token)

    def _details(self, details: Any) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            getattr(details, "compression", None),
        )

    def _intercept(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    intercept_unary_unary = _intercept
    intercept_unary_stream = _intercept
    intercept_stream_unary = _intercept
    intercept_stream_stream = _intercept


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
