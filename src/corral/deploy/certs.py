"""A development certificate authority and a server certificate signed by it (`corral deploy certs`).
Run again, it signs a new server certificate with the CA already in the folder (clients that trust its
ca.crt keep working); `--new-ca` replaces the CA.

For a test bench or a private network: clients trust `ca.crt` (the openai client through
`httpx.Client(verify="ca.crt")`, curl through `--cacert`). For the public internet use a certificate from a
public CA (e.g. Let's Encrypt) and point `deploy.edge.cert`/`key` or `gateway.tls` at it instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateError", "DevCertificates", "write_dev_certificates"]


@dataclass(frozen=True)
class DevCertificates:
    """The files written: the CA's certificate and key, and the server's."""

    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path


_CA_DAYS = 3650
_COMMON_NAME_MAX = 64  # X.509's upper bound on a common name (a DNS name may be longer: SAN only)
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class CertificateError(ValueError):
    """The certificate cannot be made as asked (a name that is no host name or address), or the folder's
    CA cannot be reused as it is; the message says why and what to do."""


def write_dev_certificates(
    directory: Path, names: list[str], days: int = 825, new_ca: bool = False
) -> tuple[DevCertificates, bool]:
    """Write a server certificate for `names` (host names and IP addresses) into `directory`, signed by the
    CA already there (so clients that trust its ca.crt keep working), or by a new CA (valid 10 years) when
    there is none or `new_ca` says so. Keys are ECDSA P-256, written with mode 0600; the server certificate
    is valid for `days`. (files, whether the CA is new); CertificateError for a CA that cannot be reused."""
    if not names:
        raise CertificateError("name at least one host name or address for the certificate")
    alt_names = [_general_name(n) for n in names]
    directory.mkdir(parents=True, exist_ok=True)
    files = DevCertificates(
        directory / "ca.crt", directory / "ca.key", directory / "server.crt", directory / "server.key"
    )
    now = datetime.datetime.now(datetime.UTC)
    made = new_ca or not (files.ca_cert.exists() or files.ca_key.exists())
    if made:
        ca_key, ca_cert = _new_ca(now)
    else:
        ca_key, ca_cert = _existing_ca(files, now + datetime.timedelta(days=days))
    key = ec.generate_private_key(ec.SECP256R1())
    # Clients check the names in subjectAltName; the common name only labels the certificate.
    label = next((n for n in names if len(n) <= _COMMON_NAME_MAX), "corral server")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
    cert = (
        _builder(subject, ca_cert.subject, key.public_key(), now, days)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    if made:
        files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        _write_private(files.ca_key, ca_key)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.key, key)
    return files, made


def _new_ca(now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral development CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now, _CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def _existing_ca(
    files: DevCertificates, needed_until: datetime.datetime
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The CA in the folder, if its certificate and key are both there, match, and outlive the new
    server certificate."""
    fix = "or pass --new-ca to make a new one (clients must then trust the new ca.crt)"
    if not (files.ca_cert.exists() and files.ca_key.exists()):
        present = files.ca_cert if files.ca_cert.exists() else files.ca_key
        raise CertificateError(f"{present} is there without its pair; restore it, {fix}")
    try:
        ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    except ValueError as exc:
        raise CertificateError(f"cannot read the CA in {files.ca_cert.parent}: {exc}; {fix}") from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or ca_key.public_key() != ca_cert.public_key():
        raise CertificateError(f"{files.ca_key} is not the key of {files.ca_cert}; {fix}")
    if ca_cert.not_valid_after_utc < needed_until:
        raise CertificateError(
            f"{files.ca_cert} expires on {ca_cert.not_valid_after_utc:%Y-%m-%d}, before the new server "
            f"certificate would; ask for fewer --days, {fix}"
        )
    return ca_key, ca_cert


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    days: int,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(name: str) -> x509.GeneralName:
    """An IP address, or a DNS name (letters, digits and hyphens in dot-separated labels, a `*.` wildcard
    first); CertificateError for anything else."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    labels = name.removeprefix("*.").removesuffix(".").split(".")
    if len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise CertificateError(
            f"{name!r} is neither an IP address nor a host name: a host name is labels of letters, digits "
            "and hyphens (at most 63 each, 253 in all) separated by dots, e.g. llm.example.com (an "
            "internationalised name in its xn-- form)"
        )
    return x509.DNSName(name)


def _write_private(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write the key into a new file of mode 0600 beside `path`, then rename it over `path`: the key is
    never in a file others may read, even for a moment (an existing file's mode, and any reader that
    opened it, would be kept by writing into it)."""
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # (mkstemp: mode 0600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)  # (only left where writing or renaming failed)
