"""Hardware, model, quantization and API-price catalogs: data files, not code.

The built-in files live in `corral/perf/data/`. A user adds or overrides entries with their own YAML files
of the same shape (`gpus:`, `models:`, `quantizations:`, `apis:` lists); an entry with an existing name
replaces the built-in one.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

__all__ = ["GPU", "ApiPrice", "Catalog", "CatalogError", "ModelArch", "Quantization", "load_catalog"]


class CatalogError(ValueError):
    """An unknown name, or a catalog file that cannot be used."""


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float | None
    interconnect_gbs: float
    gpus_per_node: int
    tdp_w: float
    price_per_hour: float
    source: str
    aliases: tuple[str, ...] = ()
    kind: str = "gpu"  # "cpu": a CPU measured as an accelerator, searched only when named
    memory_mib: float | None = None  # what the driver reports (nvidia-smi "Total"), where known
    allreduce_gbs: float | None = None  # an all-reduce's measured bus bandwidth (None: interconnect_gbs)
    allreduce_latency_us: float = 15.0  # a small all-reduce's time (NVLink; PCIe cards set their own)
    int8_tops: float | None = None  # dense INT8 tensor TOPS (W8A8 GEMMs); None: int8 runs as bf16

    @property
    def allreduce_bus_gbs(self) -> float:
        return self.allreduce_gbs or self.interconnect_gbs

    @property
    def memory_bytes(self) -> float:
        """The card's memory: the driver's figure where the catalog has it (an "80 GB" H100 holds
        80 GiB), else `memory_gb` as 10⁹ bytes."""
        return self.memory_mib * 2**20 if self.memory_mib else self.memory_gb * 1e9


@dataclass(frozen=True)
class ModelArch:
    name: str
    params_b: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_context: int
    source: str
    active_params_b: float | None = None
    tied_embeddings: bool = False
    experts: int = 0
    active_experts: int = 0
    sliding_window: int | None = None
    sliding_layers: int = 0
    attention_chunk: int | None = None
    chunked_layers: int = 0
    mla_kv_rank: int | None = None
    mla_rope_dim: int = 0
    native_quant: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def active_params(self) -> float:
        return (self.active_params_b or self.params_b) * 1e9

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)


@dataclass(frozen=True)
class Quantization:
    name: str
    bits: float
    compute: str
    quantize_embeddings: bool
    source: str
    aliases: tuple[str, ...] = ()

    @property
    def bytes_per_weight(self) -> float:
        return self.bits / 8


@dataclass(frozen=True)
class ApiPrice:
    name: str
    input_per_m: float
    output_per_m: float
    source: str
    aliases: tuple[str, ...] = ()


T = TypeVar("T", GPU, ModelArch, Quantization, ApiPrice)


@dataclass(frozen=True)
class _Table(Generic[T]):
    kind: str
    entries: Mapping[str, T] = field(default_factory=dict)

    def get(self, name: str) -> T:
        key = name.lower()
        for entry in self.entries.values():
            if key == entry.name.lower() or key in (a.lower() for a in entry.aliases):
                return entry
        close = difflib.get_close_matches(key, [e.name for e in self.entries.values()], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(self.names())}"
        raise CatalogError(f"unknown {self.kind} {name!r}{hint}")

    def names(self) -> list[str]:
        return list(self.entries)

    def __iter__(self) -> Any:
        return iter(self.entries.values())


@dataclass(frozen=True)
class Catalog:
    gpus: _Table[GPU]
    models: _Table[ModelArch]
    quantizations: _Table[Quantization]
    apis: _Table[ApiPrice]


_KINDS: dict[str, tuple[str, type]] = {
    "gpus": ("GPU", GPU),
    "models": ("model", ModelArch),
    "quantizations": ("quantization", Quantization),
    "apis": ("API price", ApiPrice),
}


def load_catalog(extra_files: Iterable[Path] = ()) -> Catalog:
    """The built-in catalogs, with entries from `extra_files` added or replacing built-ins by name."""
    tables: dict[str, dict[str, Any]] = {key: {} for key in _KINDS}
    data_dir = resources.files("corral.perf") / "data"
    texts = [(f"corral/perf/data/{key}.yaml", (data_dir / f"{key}.yaml").read_text()) for key in _KINDS]
    for path in extra_files:
        try:
            texts.append((str(path), Path(path).read_text()))
        except OSError as exc:
            raise CatalogError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    for origin, text in texts:
        try:
            document = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{origin}:{mark.line + 1}" if mark is not None else origin
            raise CatalogError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
        if not isinstance(document, dict):
            raise CatalogError(f"{origin}: expected a mapping with gpus/models/quantizations/apis lists")
        for key, entries in document.items():
            if key not in _KINDS:
                raise CatalogError(f"{origin}: unknown section {key!r}; expected one of {', '.join(_KINDS)}")
            if not isinstance(entries, list | None):
                raise CatalogError(f"{origin}: {key} must be a list of entries")
            for raw in entries or []:
                entry = _entry(_KINDS[key][1], raw, origin)
                tables[key][entry.name] = entry
    return Catalog(
        gpus=_Table("GPU", tables["gpus"]),
        models=_Table("model", tables["models"]),
        quantizations=_Table("quantization", tables["quantizations"]),
        apis=_Table("API price", tables["apis"]),
    )


def _entry(cls: type, raw: Any, origin: str) -> Any:
    if not isinstance(raw, dict) or "name" not in raw:
        raise CatalogError(f"{origin}: each entry needs a name: {raw!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise CatalogError(f"{origin}: {raw['name']}: unknown fields {', '.join(sorted(unknown))}")
    values = {**raw, "aliases": tuple(str(a) for a in raw.get("aliases", ()))}
    if "source" not in values:
        values["source"] = f"user catalog {origin}"
    required = [f for f in known.values() if f.default is MISSING and f.default_factory is MISSING]
    missing = [f.name for f in required if f.name not in values]
    if missing:
        raise CatalogError(f"{origin}: {raw['name']}: missing fields {', '.join(missing)}")
    for name, value in values.items():
        if _numeric(known[name].type) and not (value is None and "None" in str(known[name].type)):
            if problem := _number_problem(name, value, str(known[name].type).startswith("int")):
                raise CatalogError(f"{origin}: {raw['name']}: {name} {problem}")
    return cls(**values)


# Figures that may be 0 (a card you own, a dense model's experts, a free API); every other one is a size,
# a rate or a count the planner divides by or takes a remainder of, so must be above 0.
_MAY_BE_ZERO = frozenset(
    {
        "tdp_w",
        "price_per_hour",
        "allreduce_latency_us",
        "experts",
        "active_experts",
        "sliding_layers",
        "chunked_layers",
        "mla_rope_dim",
        "input_per_m",
        "output_per_m",
    }
)


def _number_problem(name: str, value: Any, whole: bool) -> str | None:
    """What is wrong with a catalog figure, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number, not {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, not {value!r}"
    if whole and value != int(value):
        return f"must be a whole number, not {value!r}"
    if value < 0 or (value == 0 and name not in _MAY_BE_ZERO):
        return f"must be {'0 or more' if name in _MAY_BE_ZERO else 'above 0'}, not {value!r}"
    return None


def _numeric(annotation: Any) -> bool:
    """A dataclass field that holds a number (annotations are strings under postponed evaluation)."""
    text = str(annotation)
    return text.split(" |")[0] in {"float", "int"}
