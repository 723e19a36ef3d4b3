"""A shard the worker cannot reach, or reach only with the wrong TLS: a fast warning, an
error that says why, and no silent two-minute wait."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from ports import refused_address

import psworker
from psctl.certs import CertPaths, write_certs
from psserver.records import Limits
from psserver.server import RunningServer, start_server
from psserver.shard import Shard
from pswire.security import ServerSecurity

MODEL = {"w": np.zeros(3, np.float32)}
SECURITY_ENV = ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_TOKEN", "PS_TOKEN_FILE")
# "within 10 s of the first attempt" with a small timeout (the bound, generous here).
SMALL_TIMEOUT_S = 2.0
FAIL_WITHIN_S = 10.0
WARN_WITHIN_S = 2.0


@pytest.fixture(autouse=True)
def no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return write_certs(tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"])


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return write_certs(tmp_path_factory.mktemp("other"), ["127.0.0.1", "localhost"])


@pytest.fixture
def serve() -> Iterator[Callable[[ServerSecurity], RunningServer]]:
    started: list[RunningServer] = []

    def make(security: ServerSecurity) -> RunningServer:
        server = start_server(Shard(Limits(max_wait_s=5.0)), security=security)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop(grace=0.5)


def init_error(address: str, **security: str) -> tuple[psworker.PSError, float]:
    """The error init raises with a small timeout, and how long it took."""
    start = time.monotonic()
    with (
        psworker.connect(
            [address], worker_id=0, num_workers=1, timeout=SMALL_TIMEOUT_S, **security
        ) as client,
        pytest.raises(psworker.UnavailableError) as info,
    ):
        client.init(MODEL, psworker.SGD(lr=0.1))
    return info.value, time.monotonic() - start


@pytest.mark.timeout(30)
def test_unreachable_shard_fails_fast_saying_nothing_listens() -> None:
    address = refused_address()
    error, took = init_error(address)
    assert took < FAIL_WITHIN_S
    text = str(error)
    assert address in text and "unreachable for" in text
    assert "nothing accepts connections there: is the shard running" in text


@pytest.mark.timeout(30)
def test_plaintext_client_against_tls_shard_names_tls(serve, certs: CertPaths) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key))
    error, took = init_error(server.address)
    assert took < FAIL_WITHIN_S
    assert "TLS mismatch" in str(error) and "as a TLS shard does to a plaintext client" in str(
        error
    )
    assert "tls_ca" in str(error)


@pytest.mark.timeout(30)
def test_tls_client_against_plaintext_shard_names_tls(serve, certs: CertPaths) -> None:
    server = serve(ServerSecurity())
    error, took = init_error(server.address, tls_ca=str(certs.ca))
    assert took < FAIL_WITHIN_S
    text = str(error)
    assert "TLS mismatch: this client expects TLS" in text
    assert "answers in plaintext" in text and str(certs.ca) in text


@pytest.mark.timeout(30)
def test_wrong_ca_names_the_ca_the_client_trusts(
    serve, certs: CertPaths, other_certs: CertPaths
) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key))
    error, took = init_error(server.address, tls_ca=str(other_certs.ca))
    assert took < FAIL_WITHIN_S
    text = str(error)
    assert "not signed by the CA this client trusts" in text and str(other_certs.ca) in text


@pytest.mark.timeout(30)
def test_mutual_tls_without_a_client_certificate_names_it(serve, certs: CertPaths) -> None:
    server = serve(ServerSecurity(cert=certs.server_cert, key=certs.server_key, ca=certs.ca))
    error, took = init_error(server.address, tls_ca=str(certs.ca))
    assert took < FAIL_WITHIN_S
    text = str(error)
    assert "demanding mutual TLS" in text and "no tls_cert" in text


@pytest.mark.timeout(30)
def test_default_timeout_warns_at_once_and_close_ends_the_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="psworker.link")
    address = refused_address()
    client = psworker.connect([address], worker_id=0, num_workers=1)  # default timeout
    assert isinstance(client, psworker.PSClient) and client.timeout >= 60
    outcome: list[BaseException] = []

    def init() -> None:
        try:
            client.init(MODEL, psworker.SGD(lr=0.1))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=init, daemon=True)
    thread.start()
    deadline = time.monotonic() + WARN_WITHIN_S
    warnings: list[str] = []
    while not warnings and time.monotonic() < deadline:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        time.sleep(0.02)
    assert warnings, f"no warning within {WARN_WITHIN_S}s"
    assert address in warnings[0] and "unreachable; retrying for up to" in warnings[0]
    assert "until" in warnings[0] and "nothing accepts connections" in warnings[0]
    client.close()  # a retrying call ends at once, not after the 120 s
    thread.join(timeout=5.0)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], psworker.ClientClosedError), outcome


@pytest.mark.timeout(30)
def test_warning_repeats_while_retrying_and_says_when_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psworker.link

    monkeypatch.setattr(psworker.link, "WARN_EVERY_S", 0.3)
    caplog.set_level(logging.WARNING, logger="psworker.link")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = psworker.connect([f"127.0.0.1:{port}"], worker_id=0, num_workers=1, timeout=20)
    thread = threading.Thread(target=client.init, args=(MODEL, psworker.SGD(lr=0.1)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum("still unreachable after" in r.getMessage() for r in caplog.records):
            break
        time.sleep(0.05)
    server = start_server(Shard(), port=port)  # the shard comes up on the address at last
    try:
        thread.join(timeout=15)
        assert not thread.is_alive()
        messages = [r.getMessage() for r in caplog.records]
        assert any("still unreachable after" in m for m in messages), messages
        assert any(m.endswith("shard reachable again") for m in messages), messages
        assert client.shard_map is not None  # init went through
    finally:
        client.close()
        server.stop(grace=0.5)


def test_address_without_port_is_refused() -> None:
    with pytest.raises(psworker.ConfigError, match="'localhost' is not host:port") as info:
        psworker.connect(["localhost"], worker_id=0, num_workers=1)
    assert isinstance(info.value, ValueError)
    with pytest.raises(psworker.ConfigError, match=r"port 0 is not in 1\.\.65535"):
        psworker.connect(["127.0.0.1:0"], worker_id=0, num_workers=1)


def test_missing_ca_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(psworker.ConfigError, match="cannot read TLS CA certificate") as info:
        psworker.connect(["127.0.0.1:7001"], worker_id=0, num_workers=1, tls_ca=str(missing))
    assert isinstance(info.value, ValueError) and str(missing) in str(info.value)
