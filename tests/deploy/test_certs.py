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


def test_a_new_key_never_reaches_a_reader_of_the_old_world_readable_file(tmp_path: Path) -> None:
    """The key was written into the existing file (O_TRUNC) and chmodded after: a server.key left 0644,
    or anyone who had opened it, read the new key."""
    folder = tmp_path / "tls"
    assert certs(folder)[0] == 0
    key = folder / "server.key"
    key.chmod(0o644)
    old = key.read_bytes()
    with key.open("rb") as reader:  # opened while the file was readable by all
        assert certs(folder)[0] == 0
        assert reader.read() == old  # it still sees the old file, not the new key
    new = key.read_bytes()
    assert new != old and b"PRIVATE KEY" in new
    assert key.stat().st_mode & 0o777 == 0o600 and (folder / "ca.key").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "ca.key", "server.crt", "server.key"]


def test_a_name_that_is_no_host_name_is_an_error_and_a_long_one_is_served(tmp_path: Path) -> None:
    """'bad name' was signed as a DNS name; a name over 64 characters ended the command with a traceback
    (X.509 bounds the common name, not the names clients check)."""
    folder = tmp_path / "tls"
    code, said = certs(folder, "--name", "bad name")
    assert code == 1 and "'bad name' is neither an IP address nor a host name" in said, said
    assert not (folder / "server.crt").exists()
    long_name = "a" * 60 + ".gateway.example.com"  # 80 characters, a valid DNS name
    code, said = certs(folder, "--name", long_name, "--name", "10.0.0.5")
    assert code == 0 and "Traceback" not in said, said
    cert = x509.load_pem_x509_certificate((folder / "server.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [long_name] and signed_by(folder)
