"""`corral deploy certs` run again keeps the folder's CA (it replaced it, so every client trusting the old
ca.crt broke); `--new-ca` replaces it on purpose; a CA it cannot reuse is an error saying what to do."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from typer.testing import CliRunner

from corral.cli import app


def certs(folder: Path, *extra: str) -> tuple[int, str]:
    done = CliRunner().invoke(app, ["deploy", "certs", "-o", str(folder), *extra])
    return done.exit_code, " ".join(done.output.split())


def signed_by(folder: Path) -> bool:
    """server.crt verifies under the folder's ca.crt."""
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((folder / "server.crt").read_bytes())
    try:
        cert.verify_directly_issued_by(ca)
    except InvalidSignature:
        return False
    return True


def test_a_second_run_signs_with_the_ca_already_there(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    code, said = certs(folder)
    assert code == 0 and "a new CA" in said, said
    ca = (folder / "ca.crt").read_bytes()
    first = (folder / "server.crt").read_bytes()
    code, said = certs(folder, "--name", "gateway.internal")
    assert code == 0 and "signed by the CA already in" in said, said
    assert (folder / "ca.crt").read_bytes() == ca  # clients trusting it keep working
    assert (folder / "server.crt").read_bytes() != first and signed_by(folder)
    code, said = certs(folder, "--new-ca")
    assert code == 0 and "a new CA" in said and (folder / "ca.crt").read_bytes() != ca and signed_by(folder)


def test_a_ca_without_its_key_is_an_error_naming_the_way_out(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    assert certs(folder)[0] == 0
    (folder / "ca.key").unlink()
    code, said = certs(folder)
    assert code == 1 and "without its pair" in said and "--new-ca" in said, said
