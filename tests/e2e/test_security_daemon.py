"""The psserver daemon with --tls-cert, --tls-key and --token-file serves TLS clients."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from e2e_support import Processes, child_env, wait_port_file
from grpc_health.v1 import health_pb2, health_pb2_grpc

import psworker
from psctl.certs import write_certs
from pswire.security import ClientSecurity

TOKEN = "e2e-token-0123456789"


@pytest.mark.timeout(60)
def test_daemon_serves_tls_and_checks_the_token(procs: Processes, tmp_path: Path) -> None:
    certs = write_certs(tmp_path / "certs", ["127.0.0.1", "localhost"])
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port_file = tmp_path / "ps.port"
    args = [sys.executable, "-m", "psserver", "--host", "127.0.0.1", "--port", "0"]
    args += ["--port-file", str(port_file), "--tls-cert", str(certs.server_cert)]
    args += ["--tls-key", str(certs.server_key), "--token-file", str(token_file), "--grace", "1"]
    daemon = procs.start(args, env=child_env())
    port = wait_port_file(daemon, port_file, timeout=30.0)
    address = f"127.0.0.1:{port}"

    # Health needs TLS but no token, so orchestrators can probe.
    with ClientSecurity(ca=certs.ca).channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10, wait_for_ready=True
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

    model = {"w": np.arange(4, dtype=np.float32)}
    right = {"tls_ca": str(certs.ca), "token": TOKEN}
    with psworker.connect(
        [address], worker_id=0, num_workers=1, mode="async", timeout=10, **right
    ) as client:
        client.init(model, psworker.SGD(lr=1.0))
        client.push({"w": np.ones(4, np.float32)})
        np.testing.assert_array_equal(client.pull()["w"], model["w"] - 1.0)

    with psworker.connect(
        [address], worker_id=0, num_workers=1, mode="async", timeout=5, tls_ca=str(certs.ca)
    ) as intruder:
        with pytest.raises(psworker.UnauthenticatedError) as info:
            intruder.init(model, psworker.SGD(lr=1.0))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

    daemon.send_signal(signal.SIGTERM)
    out, _ = daemon.communicate(timeout=15)
    assert daemon.returncode == 0, out
    assert f"psserver listening on 127.0.0.1:{port} (TLS, token required)" in out
    assert TOKEN not in out, "the daemon must never log its token"
