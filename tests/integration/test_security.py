"""TLS, mutual TLS and the shared token on real servers: only the right client gets in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psworker
from psctl.certs import CertPaths, write_certs
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.security import ClientSecurity, ServerSecurity
from pswire.write import tensor_to_chunks
from psworker.link import shard_status

TOKEN = "s3cret-token_for.tests"
MODEL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
GRAD = {"w": np.ones((2, 3), np.float32), "b": np.full(3, 2.0, np.float32)}
LIMITS = Limits(max_wait_s=5.0)
SECURITY_ENV = ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_TOKEN", "PS_TOKEN_FILE")


@pytest.fixture(autouse=True)
def no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's own PS_TLS_*/PS_TOKEN settings must not leak into these tests."""
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return write_certs(tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"])


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    """A second, unrelated CA and its certificates: what an impostor would hold."""
    return write_certs(tmp_path_factory.mktemp("other"), ["127.0.0.1", "localhost"])


@pytest.fixture
def serve() -> Iterator[Callable[[ServerSecurity], RunningServer]]:
    started: list[RunningServer] = []

    def make(security: ServerSecurity) -> RunningServer:
        server = start_server(Shard(LIMITS), security=security)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop(grace=0.5)


def trained(server: RunningServer, **credentials: Any) -> psworker.PSClient:
    """A client with the right credentials that has initialised the shard and pushed once."""
    client = psworker.connect(
        [server.address], worker_id=0, num_workers=1, mode="async", timeout=10, **credentials
    )
    assert isinstance(client, psworker.PSClient)
    client.init(MODEL, psworker.SGD(lr=0.5))
    client.push(GRAD)
    np.testing.assert_allclose(client.pull()["w"], MODEL["w"] - 0.5)
    return client


def state(server: RunningServer) -> tuple:
    """Variables, clocks, counters and membership: what a refused call must leave alone."""
    st = server.shard.status()
    values = {k: v.tobytes() for k, v in server.shard.snapshot().items()}
    workers = {w: clock for w, (clock, _age) in st.workers.items()}
    return values, st.initialized, st.clock, st.pushes_applied, st.pushes_duplicate, workers


def raw_push(security: ClientSecurity, address: str, metadata: Any = None) -> grpc.RpcError:
    """A well-formed push for step 1 over a channel with ``security``; returns its failure."""

    def stream() -> Iterator[ps_pb2.PushRequest]:
        yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker_id=0, step=1))
        for name, grad in GRAD.items():
            for chunk in tensor_to_chunks(name, grad):
                yield ps_pb2.PushRequest(chunk=chunk)

    with security.channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Push(stream(), timeout=5, metadata=metadata)
    return info.value


def refused_by_transport(server: RunningServer, security: ClientSecurity) -> None:
    """A client with the wrong transport credentials is UNAVAILABLE and changes nothing."""
    before = state(server)
    # A short timeout: the client retries UNAVAILABLE (a shard may be restarting) until then.
    client = psworker.PSClient(
        psworker.ClientSettings(
            addresses=(server.address,), mode="async", timeout=1, security=security
        )
    )
    try:
        with pytest.raises(psworker.UnavailableError) as info:
            client.init(MODEL, psworker.SGD(lr=0.5))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(psworker.UnavailableError):
            client.status()
    finally:
        client.close()
    assert raw_push(security, server.address).code() == grpc.StatusCode.UNAVAILABLE
    assert state(server) == before


def health(security: ClientSecurity, address: str) -> int:
    with security.channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


# -- TLS ------------------------------------------------------------------------------------


def test_tls_client_with_the_right_ca_trains(serve, certs: CertPaths) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key))
    client = trained(server, tls_ca=str(certs.ca))
    assert client.status()[0].initialized
    client.close()


def test_tls_plaintext_or_wrong_ca_client_is_unavailable(
    serve, certs: CertPaths, other_certs: CertPaths
) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key))
    trained(server, tls_ca=str(certs.ca)).close()
    refused_by_transport(server, ClientSecurity())
    refused_by_transport(server, ClientSecurity(ca=other_certs.ca))


# -- mutual TLS -----------------------------------------------------------------------------


def test_mtls_client_with_a_certificate_from_the_ca_trains(serve, certs: CertPaths) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key, ca=certs.ca))
    client = trained(
        server, tls_ca=str(certs.ca), tls_cert=str(certs.client_cert), tls_key=str(certs.client_key)
    )
    client.close()


def test_mtls_client_without_a_certificate_or_from_another_ca_is_unavailable(
    serve, certs: CertPaths, other_certs: CertPaths
) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key, ca=certs.ca))
    right = {"ca": certs.ca, "cert": certs.client_cert, "key": certs.client_key}
    trained(server, tls_ca=right["ca"], tls_cert=right["cert"], tls_key=right["key"]).close()
    refused_by_transport(server, ClientSecurity(ca=certs.ca))
    refused_by_transport(
        server,
        ClientSecurity(ca=certs.ca, cert=other_certs.client_cert, key=other_certs.client_key),
    )
    # The server certificate is a peer's (all-reduce workers present it both ways), so it is
    # also a client certificate; a client certificate is not a server's (extended key usage).
    peer = ClientSecurity(ca=certs.ca, cert=certs.server_cert, key=certs.server_key)
    assert shard_status([server.address], 10, peer)[0].initialized
    client_as_server = serve(
        ServerSecurity(cert=certs.client_cert, key=certs.client_key, ca=certs.ca)
    )
    refused_by_transport(client_as_server, ClientSecurity(**right))


# -- token ----------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1]])
def test_missing_or_wrong_token_is_unauthenticated_and_changes_nothing(serve, token) -> None:
    server = serve(ServerSecurity(token=TOKEN))
    trained(server, token=TOKEN).close()
    before = state(server)

    intruder = psworker.PSClient(
        psworker.ClientSettings(
            addresses=(server.address,),
            mode="async",
            timeout=5,
            security=ClientSecurity(token=token),
        )
    )
    try:
        with pytest.raises(psworker.UnauthenticatedError) as info:
            intruder.init(MODEL, psworker.SGD(lr=0.5))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in str(info.value)
        assert TOKEN not in str(info.value), "the error must not echo the server's token"
        with pytest.raises(psworker.UnauthenticatedError):
            intruder.heartbeat()
        with pytest.raises(psworker.UnauthenticatedError):
            intruder.status()
    finally:
        intruder.close()
    error = raw_push(ClientSecurity(token=token), server.address)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    # A token in the wrong header form (no "Bearer ") is no token either.
    bare = raw_push(ClientSecurity(), server.address, metadata=[("authorization", TOKEN)])
    assert bare.code() == grpc.StatusCode.UNAUTHENTICATED
    assert state(server) == before


def test_health_answers_without_the_token(serve) -> None:
    server = serve(ServerSecurity(token=TOKEN))
    assert health(ClientSecurity(), server.address) == health_pb2.HealthCheckResponse.SERVING


def test_right_token_from_the_environment(serve, monkeypatch, tmp_path: Path) -> None:
    server = serve(ServerSecurity(token=TOKEN))
    monkeypatch.setenv("PS_TOKEN", TOKEN)
    trained(server).close()
    monkeypatch.delenv("PS_TOKEN")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("PS_TOKEN_FILE", str(token_file))
    # psctl status goes through this function: it honours the same variables.
    assert shard_status([server.address], timeout=5)[0].initialized
    monkeypatch.delenv("PS_TOKEN_FILE")
    with pytest.raises(psworker.UnauthenticatedError):
        shard_status([server.address], timeout=5)


# -- TLS and token together -----------------------------------------------------------------


def test_tls_and_token_need_both(serve, certs: CertPaths, monkeypatch) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key, token=TOKEN))
    monkeypatch.setenv("PS_TLS_CA", str(certs.ca))
    monkeypatch.setenv("PS_TOKEN", TOKEN)
    trained(server).close()  # both from the environment
    monkeypatch.delenv("PS_TLS_CA")
    monkeypatch.delenv("PS_TOKEN")
    before = state(server)

    with pytest.raises(psworker.UnauthenticatedError):
        shard_status([server.address], 5, ClientSecurity(ca=certs.ca))
    with pytest.raises(psworker.UnauthenticatedError):
        shard_status([server.address], 5, ClientSecurity(ca=certs.ca, token="nope"))
    with pytest.raises(psworker.UnavailableError):
        shard_status([server.address], 5, ClientSecurity(token=TOKEN))
    wrong_token = raw_push(ClientSecurity(ca=certs.ca, token="nope"), server.address)
    assert wrong_token.code() == grpc.StatusCode.UNAUTHENTICATED
    assert raw_push(ClientSecurity(token=TOKEN), server.address).code() == (
        grpc.StatusCode.UNAVAILABLE
    )
    assert state(server) == before
    assert health(ClientSecurity(ca=certs.ca), server.address) == (
        health_pb2.HealthCheckResponse.SERVING
    )


# -- configuration --------------------------------------------------------------------------


def test_bad_settings_fail_before_serving(certs: CertPaths, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        ServerSecurity(cert=certs.server_cert)
    with pytest.raises(ValueError, match="needs --tls-cert"):
        ServerSecurity(ca=certs.ca)
    with pytest.raises(ValueError, match="printable"):
        ServerSecurity(token="has space")
    with pytest.raises(ValueError, match="empty"):
        ClientSecurity(token="")
    with pytest.raises(ValueError, match=r"missing\.pem"):
        start_server(security=ServerSecurity(cert=tmp_path / "missing.pem", key=certs.server_key))
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="not a PEM"):
        ClientSecurity(ca=not_pem).channel("127.0.0.1:1")


def test_connect_arguments_win_over_environment(monkeypatch, certs: CertPaths) -> None:
    monkeypatch.setenv("PS_TLS_CA", "/nowhere/ca.pem")
    monkeypatch.setenv("PS_TOKEN", "from-env")
    security = ClientSecurity.from_env(ca=certs.ca, token="from-arg")
    assert security.ca == certs.ca and security.token == "from-arg"
    security = ClientSecurity.from_env()
    assert security.ca == Path("/nowhere/ca.pem") and security.token == "from-env"


def _ring_pair(certs: CertPaths, tokens: tuple[str, str], timeout: float = 10.0):
    """Two all-reduce workers, each with a TLS + token ring server; returns their outcomes."""
    import threading

    from psworker.ring.flight_transport import RingServer

    servers = [
        RingServer(
            "127.0.0.1:0",
            security=ServerSecurity(
                cert=certs.server_cert, key=certs.server_key, ca=certs.ca, token=token
            ),
        )
        for token in tokens
    ]
    peers = [s.address for s in servers]
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            with psworker.connect(
                peers,
                mode="allreduce",
                worker_id=i,
                tls_ca=str(certs.ca),
                tls_cert=str(certs.server_cert),
                tls_key=str(certs.server_key),
                token=tokens[i],
                server=servers[i],
                timeout=timeout,
            ) as client:
                client.init({"w": np.zeros(3, np.float32)}, psworker.SGD(lr=1.0))
                client.push({"w": np.full(3, i + 1.0, np.float32)})
                results[i] = client.pull()["w"]
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)
    assert len(results) == 2, "a ring worker hung"
    return results


def test_the_allreduce_ring_runs_over_mutual_tls_with_the_token(certs: CertPaths) -> None:
    results = _ring_pair(certs, ("ring-secret", "ring-secret"))
    for i in (0, 1):
        assert isinstance(results[i], np.ndarray), results[i]
        assert np.allclose(results[i], -1.5)  # minus the mean of 1 and 2


def test_a_ring_peer_with_another_token_is_refused_by_name(certs: CertPaths) -> None:
    results = _ring_pair(certs, ("ring-secret", "other-secret"), timeout=3.0)
    errors = [r for r in results.values() if isinstance(r, Exception)]
    assert errors, "a worker with the wrong token joined the ring"
    assert any("token" in str(e) or "UNAUTHENTICATED" in str(e) for e in errors), errors


def test_allreduce_tls_without_a_certificate_is_refused_before_it_starts(certs) -> None:
    with pytest.raises(ValueError, match="ring server"):
        psworker.connect(["127.0.0.1:1", "127.0.0.1:2"], mode="allreduce", tls_ca=str(certs.ca))
