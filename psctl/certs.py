"""``psctl certs``: a self-signed CA and server and client certificates for a test cluster."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pswire import cli

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 365
# File names inside --out; the key files are written 0600.
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server-key.pem"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client-key.pem"


@dataclass(frozen=True)
class CertPaths:
    """Where ``write_certs`` put each PEM file."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def write_certs(
    out: str | Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = DEFAULT_DAYS,
    overwrite: bool = False,
    ca_name: str = "psgrpc test CA",
) -> CertPaths:
    """Writes a new CA, a server certificate valid for ``hosts`` and a client certificate.

    ``hosts`` are DNS names or IP addresses; each becomes a subject alternative name of the
    server certificate, which is what TLS clients check. The server certificate serves every
    shard, so list every host a shard runs on. Keys are ECDSA P-256, written 0600.

    Raises:
        ValueError: no hosts, a bad host name, ``days`` < 1.
        FileExistsError: a file exists and ``overwrite`` is False (re-running must not
            silently replace a CA whose certificates are deployed).
        ImportError: the ``cryptography`` package is missing.
    """
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    sans = _subject_alt_names(hosts)
    out = Path(out)
    names = (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY, CLIENT_CERT, CLIENT_KEY)
    paths = CertPaths(*(out / name for name in names))
    if not overwrite:
        existing = [str(p) for p in vars(paths).values() if p.exists()]
        if existing:
            raise FileExistsError(f"refusing to overwrite {', '.join(existing)} (use --force)")
    out.mkdir(parents=True, exist_ok=True)

    ca_key = _new_key()
    ca_cert = _certificate(ca_name, ca_key, ca_key, None, days, ca=True)
    server_key = _new_key()
    server_cert = _certificate("psserver", server_key, ca_key, ca_cert, days, sans=sans)
    client_key = _new_key()
    client_cert = _certificate("psworker", client_key, ca_key, ca_cert, days, client=True)

    _write(paths.ca, _cert_pem(ca_cert), 0o644)
    _write(paths.ca_key, _key_pem(ca_key), 0o600)
    _write(paths.server_cert, _cert_pem(server_cert), 0o644)
    _write(paths.server_key, _key_pem(server_key), 0o600)
    _write(paths.client_cert, _cert_pem(client_cert), 0o644)
    _write(paths.client_key, _key_pem(client_key), 0o600)
    return paths


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Adds the ``certs`` subcommand to ``psctl``'s subparsers and returns its parser."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "certs",
        help="generate a self-signed CA and server/client certificates for a test cluster",
        description=(
            "Writes ca.pem, server.pem, client.pem and their keys (*-key.pem, mode 0600) to "
            "--out. Start shards with --tls-cert server.pem --tls-key server-key.pem, adding "
            "--tls-ca ca.pem for mutual TLS; give workers PS_TLS_CA=ca.pem, and for mutual TLS "
            "PS_TLS_CERT=client.pem PS_TLS_KEY=client-key.pem. For test clusters only: keep "
            "ca-key.pem private, or anyone holding it can mint certificates."
        ),
    )
    cli.add(
        parser,
        "--out",
        env="PS_CERTS_OUT",
        required=True,
        type=Path,
        help="folder for the PEM files",
    )
    cli.add(
        parser,
        "--hosts",
        env="PS_CERTS_HOSTS",
        default=",".join(DEFAULT_HOSTS),
        help="comma-separated DNS names and IPs the shards answer on",
    )
    cli.add(parser, "--days", env="PS_CERTS_DAYS", type=int, default=DEFAULT_DAYS, help="validity")
    cli.add(
        parser,
        "--force",
        env="PS_CERTS_FORCE",
        action="store_true",
        default=False,
        help="overwrite existing files",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs ``psctl certs`` from parsed arguments; returns the exit code."""
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        paths = write_certs(args.out, hosts, args.days, overwrite=args.force)
    except ImportError as exc:
        print(f"psctl certs needs the cryptography package ({exc})", file=sys.stderr)
        return 2
    except (ValueError, FileExistsError) as exc:
        print(f"psctl certs: {exc}", file=sys.stderr)
        return 2
    print(f"wrote CA, server ({', '.join(hosts)}) and client certificates to {args.out}:")
    for name, path in vars(paths).items():
        print(f"  {name:12} {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m psctl.certs`` (same flags as ``psctl certs``)."""
    parser = argparse.ArgumentParser(prog="psctl.certs")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["certs", *(sys.argv[1:] if argv is None else argv)]))


# -- internals ------------------------------------------------------------------------------


def _subject_alt_names(hosts: Sequence[str]) -> list[Any]:
    from cryptography import x509

    if not hosts:
        raise ValueError("give at least one host name or IP for the server certificate")
    names: list[Any] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() or c in "/:," for c in host):
                raise ValueError(f"{host!r} is neither an IP address nor a DNS name") from None
            names.append(x509.DNSName(host))
    return names


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    common_name: str,
    key: Any,
    issuer_key: Any,
    issuer_cert: Any,
    days: int,
    *,
    ca: bool = False,
    client: bool = False,
    sans: list[Any] | None = None,
) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Backdated a little: a peer whose clock runs behind must not see "not yet valid".
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        builder = builder.add_extension(usage, critical=True)
    else:
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=False,
            crl_sign=False,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=True,
            encipher_only=False,
            decipher_only=False,
        )
        # The server certificate is a peer's: all-reduce workers' ring servers present it and
        # also call their neighbours with it (mutual TLS), so it carries both purposes.
        purposes = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if not client:
            purposes = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            builder.add_extension(usage, critical=True)
            .add_extension(x509.ExtendedKeyUsage(purposes), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Writes ``path`` with ``mode`` from its creation, so a key is never readable by others."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)  # the umask may have narrowed the mode given to open
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


if __name__ == "__main__":
    raise SystemExit(main())
