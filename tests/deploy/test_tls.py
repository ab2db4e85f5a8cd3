"""Native TLS (`gateway.tls`) with the official openai client, and the client address through trusted
proxies (`gateway.trusted_proxies`) as the access log and the admin API see it."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from aiohttp.test_utils import make_mocked_request
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from corral.deploy import write_dev_certificates
from corral.gateway.clients import ClientAddresses
from tests.conftest import CORRAL, RunningCluster, cluster_of, log_has

SPEC = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
gateway:
  tls: {{cert: {tls}/server.crt, key: {tls}/server.key, check_interval: 0.3}}
  trusted_proxies: [127.0.0.1]
  access_log: true
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, replicas: 1, gpu: h100-sxm, time_scale: 20}}
"""


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    write_dev_certificates(folder, ["localhost", "127.0.0.1"])
    return folder


@pytest.fixture(scope="module")
def https_cluster(tmp_path_factory: pytest.TempPathFactory, tls_dir: Path) -> Iterator[RunningCluster]:
    context = ssl.create_default_context(cafile=tls_dir / "ca.crt")
    with cluster_of(tmp_path_factory.mktemp("https"), SPEC.format(tls=tls_dir), tls=context) as running:
        yield running


def test_openai_client_verifies_the_certificate_plain_and_streamed(
    https_cluster: RunningCluster, tls_dir: Path
) -> None:
    assert https_cluster.url.startswith("https://")
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=tls_dir / "ca.crt")) as http:
        client = openai.OpenAI(base_url=https_cluster.base_url, api_key="none", http_client=http)
        answer = client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert answer.choices[0].message.content and answer.usage and answer.usage.completion_tokens == 8
        assert answer.id == f"chatcmpl-{answer._request_id}"  # the simulator names it as vLLM does
        stream = client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text


def test_a_client_that_does_not_trust_the_ca_is_refused(https_cluster: RunningCluster) -> None:
    with openai.DefaultHttpxClient() as http:  # the system's CAs only
        client = openai.OpenAI(
            base_url=https_cluster.base_url, api_key="none", http_client=http, max_retries=0
        )
        with pytest.raises(openai.APIConnectionError) as caught:
            client.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(caught.value.__cause__)


def test_status_over_https_with_the_ca(https_cluster: RunningCluster, tls_dir: Path) -> None:
    result = subprocess.run(
        [*CORRAL, "status", "--url", https_cluster.url, "--ca-cert", str(tls_dir / "ca.crt"), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert '"state": "ready"' in result.stdout


def admin_status(cluster: RunningCluster, forwarded_for: str, request_id: str = "") -> int:
    headers = {"X-Forwarded-For": forwarded_for} | ({"X-Request-Id": request_id} if request_id else {})
    request = urllib.request.Request(cluster.url + "/admin/keys", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5, context=cluster.tls) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_trusted_proxy_names_the_client_for_the_access_log_and_admin(https_cluster: RunningCluster) -> None:
    # An open gateway without an admin key serves the admin API to local clients only: through the trusted
    # proxy (this test, on 127.0.0.1) a remote client is refused and a local one served.
    assert admin_status(https_cluster, "203.0.113.9") == 403
    assert admin_status(https_cluster, "127.0.0.1") == 200
    # The spoofed left-most hop is ignored: the nearest untrusted address counts.
    assert admin_status(https_cluster, "127.0.0.1, 198.51.100.4") == 403
    log_has(https_cluster.log, '203.0.113.9 "GET /admin/keys" 403')
    log_has(https_cluster.log, '198.51.100.4 "GET /admin/keys" 403')
    # The edge's request id (its X-Request-Id, believed from a trusted proxy) ends the line.
    assert admin_status(https_cluster, "192.0.2.7", request_id="edge0c4f") == 403
    log_has(https_cluster.log, '192.0.2.7 "GET /admin/keys" 403')
    line = next(x for x in https_cluster.log.read_text().splitlines() if '192.0.2.7 "GET /admin/keys"' in x)
    assert line.rstrip().endswith("s edge0c4f"), line


def addresses_of(trusted: list[str], peer: str, forwarded: str | None) -> tuple[str, bool]:
    headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
    request = make_mocked_request("GET", "/", headers=headers)
    request = request.clone(remote=peer)
    clients = ClientAddresses(trusted)
    return clients.of(request), clients.is_local(request)


def test_client_addresses_believe_forwarded_for_only_from_trusted_peers() -> None:
    # No trusted proxies: the header is ignored, and a proxied loopback request is not local.
    assert addresses_of([], "127.0.0.1", "203.0.113.9") == ("127.0.0.1", False)
    assert addresses_of([], "127.0.0.1", None) == ("127.0.0.1", True)
    # A trusted network: trusted hops are skipped from the right.
    assert addresses_of(["10.0.0.0/8"], "10.1.2.3", "203.0.113.9, 10.9.9.9") == ("203.0.113.9", False)
    assert addresses_of(["10.0.0.0/8"], "10.1.2.3", None) == ("10.1.2.3", False)
    # A peer outside the trusted list: its header is not believed.
    assert addresses_of(["10.0.0.0/8"], "192.0.2.1", "127.0.0.1") == ("192.0.2.1", False)
    assert addresses_of(["::1"], "::1", "2001:db8::7") == ("2001:db8::7", False)
    # A trusted proxy on another host naming 127.0.0.1 means its own machine, not this one.
    assert addresses_of(["10.0.0.0/8"], "10.1.2.3", "127.0.0.1") == ("127.0.0.1", False)
    assert addresses_of(["127.0.0.1"], "127.0.0.1", "127.0.0.1") == ("127.0.0.1", True)


def test_a_certificate_that_cannot_be_used_is_one_line_before_anything_starts(
    tmp_path: Path, tls_dir: Path
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(tls=tls_dir).replace("server.key", "ca.key"))
    result = subprocess.run([*CORRAL, "up", "-f", str(spec)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "gateway.tls: cannot use" in result.stderr and "Traceback" not in result.stderr


def _served(url: str) -> str:
    """The certificate a new connection is given, PEM."""
    where = urlsplit(url)
    return ssl.get_server_certificate((str(where.hostname), int(where.port or 443)))


def _served_soon(url: str, pem: bytes, timeout: float = 15) -> None:
    wanted = ssl.DER_cert_to_PEM_cert(ssl.PEM_cert_to_DER_cert(pem.decode()))
    deadline = time.monotonic() + timeout
    while _served(url) != wanted:
        assert time.monotonic() < deadline, "the renewed certificate was not served"
        time.sleep(0.1)


def test_a_renewed_certificate_is_served_without_a_restart(
    https_cluster: RunningCluster, tls_dir: Path
) -> None:
    """Renewal in place (a new key and certificate over the old files, as certbot or `corral deploy certs`
    write them): new connections get the new certificate within check_interval, a connection already open
    keeps working, a renewal to another key type is served whole, and a pair that does not match (either
    file changed alone) is logged and not used."""
    first = (tls_dir / "server.crt").read_bytes()
    _served_soon(https_cluster.url, first)
    where = urlsplit(https_cluster.url)
    trusted = ssl.create_default_context(cafile=tls_dir / "ca.crt")
    open_before = http.client.HTTPSConnection(str(where.hostname), where.port, context=trusted, timeout=10)
    open_before.request("GET", "/health")
    assert open_before.getresponse().read() and open_before.sock is not None
    old_der = open_before.sock.getpeercert(binary_form=True)

    write_dev_certificates(tls_dir, ["localhost", "127.0.0.1", "renewed.example"])  # same CA, new key
    renewed = (tls_dir / "server.crt").read_bytes()
    assert renewed != first
    _served_soon(https_cluster.url, renewed)
    log_has(https_cluster.log, "loaded the renewed certificate")
    with openai.DefaultHttpxClient(verify=trusted) as httpx_client:  # new connections verify against the CA
        client = openai.OpenAI(base_url=https_cluster.base_url, api_key="none", http_client=httpx_client)
        assert [m.id for m in client.models.list()] == ["llama-8b"]
    open_before.request("GET", "/health")  # the connection opened before: its certificate, still served
    assert open_before.getresponse().status == 200 and open_before.sock is not None
    assert open_before.sock.getpeercert(binary_form=True) == old_der
    open_before.close()

    # From ECDSA to RSA: loaded in place, OpenSSL would keep the ECDSA certificate beside the RSA one and
    # serve it to every client that takes ECDSA (most); a fresh context serves the RSA one alone.
    rsa_cert, rsa_key = _rsa_pair(tls_dir)
    ecdsa_cert, ecdsa_key = renewed, (tls_dir / "server.key").read_bytes()
    try:
        (tls_dir / "server.key").write_bytes(rsa_key)
        (tls_dir / "server.crt").write_bytes(rsa_cert)
        _served_soon(https_cluster.url, rsa_cert)
        refused = "new connections keep the certificate loaded before"
        for broken, name in ((ecdsa_cert, "server.crt"), ((tls_dir / "ca.key").read_bytes(), "server.key")):
            # a certificate without its key, then a key without its certificate: logged, not used
            told = https_cluster.log.read_text().count(refused)  # (a renewal caught half written counts)
            (tls_dir / name).write_bytes(broken)
            deadline = time.monotonic() + 15
            while https_cluster.log.read_text().count(refused) == told:
                assert time.monotonic() < deadline, f"the mismatched {name} was not logged"
                time.sleep(0.1)
            _served_soon(https_cluster.url, rsa_cert)  # (still the RSA one, and it works)
            with openai.DefaultHttpxClient(verify=trusted) as httpx_client:
                client = openai.OpenAI(
                    base_url=https_cluster.base_url, api_key="none", http_client=httpx_client
                )
                assert client.models.list().data
            (tls_dir / "server.crt").write_bytes(rsa_cert)
            (tls_dir / "server.key").write_bytes(rsa_key)
    finally:
        (tls_dir / "server.key").write_bytes(ecdsa_key)
        (tls_dir / "server.crt").write_bytes(ecdsa_cert)


def _rsa_pair(folder: Path) -> tuple[bytes, bytes]:
    """An RSA certificate for localhost signed by the folder's development CA (whose own key is ECDSA)."""
    ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = serialization.Encoding.PEM
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(pem), private
