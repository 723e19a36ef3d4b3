"""Security settings: psserver's flags and PS_* twins, token files, and generated certificates."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from psctl import certs
from psserver.config import parse_config
from pswire.security import ClientSecurity, ServerSecurity, read_token_file

SECURITY_ENV = ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_TOKEN", "PS_TOKEN_FILE")


@pytest.fixture(autouse=True)
def no_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's own PS_TLS_*/PS_TOKEN settings must not leak into these tests."""
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)


def test_flags_build_the_server_security(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc123\n")
    config = parse_config(
        [
            "--tls-cert",
            "s.pem",
            "--tls-key",
            "k.pem",
            "--tls-ca",
            "ca.pem",
            "--token-file",
            str(token),
        ]
    )
    assert config.security == ServerSecurity(Path("s.pem"), Path("k.pem"), Path("ca.pem"), "abc123")
    assert config.security.describe() == "mutual TLS, token required"


def test_env_twins_and_flag_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_TLS_CERT", "env.pem")
    monkeypatch.setenv("PS_TLS_KEY", "env-key.pem")
    monkeypatch.setenv("PS_TOKEN", "from-env")
    config = parse_config([])
    assert config.security.cert == Path("env.pem") and config.security.token == "from-env"
    config = parse_config(["--tls-cert", "flag.pem", "--token", "from-flag"])
    assert config.security.cert == Path("flag.pem") and config.security.token == "from-flag"


def test_impossible_settings_exit_with_usage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--tls-cert", "only-cert.pem"])
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--tls-ca", "ca.pem"])
    assert "needs --tls-cert" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--token", "a", "--token-file", str(tmp_path / "t")])
    assert "give the token once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--token-file", str(tmp_path / "missing")])
    assert "cannot read token file" in capsys.readouterr().err


def test_token_files_and_bad_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("  tok3n\r\n")
    assert read_token_file(path) == "tok3n"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(path)
    with pytest.raises(ValueError, match="printable ASCII") as info:
        ClientSecurity(token="caf\u00e9 secret")
    assert "secret" not in str(info.value), "an error must not echo the token"


def test_client_env_twins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert not ClientSecurity.from_env().tls
    monkeypatch.setenv("PS_TLS_CA", "ca.pem")
    monkeypatch.setenv("PS_TLS_CERT", "c.pem")
    monkeypatch.setenv("PS_TLS_KEY", "k.pem")
    token = tmp_path / "token"
    token.write_text("from-file")
    monkeypatch.setenv("PS_TOKEN_FILE", str(token))
    security = ClientSecurity.from_env()
    assert security == ClientSecurity(Path("ca.pem"), Path("c.pem"), Path("k.pem"), "from-file")
    monkeypatch.setenv("PS_TOKEN", "from-var")
    assert ClientSecurity.from_env().token == "from-var"
    assert ClientSecurity.from_env(token="arg").token == "arg"


def test_generated_certificates(tmp_path: Path) -> None:
    paths = certs.write_certs(tmp_path / "c", ["127.0.0.1", "ps-0.example", "::1"], days=3)
    for key in (paths.ca_key, paths.server_key, paths.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    ca = x509.load_pem_x509_certificate(paths.ca.read_bytes())
    server = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    client = x509.load_pem_x509_certificate(paths.client_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for cert in (server, client):
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["ps-0.example"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_certs_command_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c"
    assert certs.main(["--out", str(out), "--hosts", "127.0.0.1,localhost"]) == 0
    ca = (out / certs.CA_CERT).read_bytes()
    assert certs.main(["--out", str(out)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (out / certs.CA_CERT).read_bytes() == ca
    assert certs.main(["--out", str(out), "--force"]) == 0
    assert (out / certs.CA_CERT).read_bytes() != ca
    assert certs.main(["--out", str(tmp_path / "d"), "--hosts", "bad host"]) == 2
