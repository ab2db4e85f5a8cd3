"""Sizing search: the cheapest layouts (GPU type, TP × PP per replica, replicas) that fit and meet the SLOs.

For each GPU type and each parallel layout a replica could use, memory decides whether the model fits at
all (weights, activations and overhead, plus the KV of at least one full-context sequence: a layout that
does not fit is never reported). Then replicas are added until the load, split evenly, meets the TTFT and
ITL targets, each replica's latency coming from the scheduler model in virtual time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from corral.perf import (
    BLOCK_SIZE,
    GPU,
    KEEPS_UP,
    Catalog,
    Efficiency,
    LoadResult,
    MemoryPlan,
    ModelArch,
    PerfModel,
    Quantization,
    SchedulerConfig,
    closed_loop,
    memory_plan,
    open_loop,
    saturated_rate,
    sequence_kv_bytes,
)
from corral.plan.cost import CostReport, cost_report

__all__ = ["Layout", "PlanRequest", "PlanResult", "plan"]

HOURS_PER_MONTH = 730
_TP_CHOICES = (1, 2, 4, 8)
_PP_CHOICES = (1, 2, 4)


@dataclass(frozen=True)
class PlanRequest:
    model: str
    gpu: str = "all"
    gpus: int | None = None
    quant: str | None = None
    context: int | None = None
    concurrency: int = 16
    request_rate: float | None = None  # requests/s (Poisson arrivals); replaces `concurrency` when set

    @property
    def has_slo(self) -> bool:
        return self.ttft_p95_ms is not None or self.itl_ms is not None

    input_len: int = 1024
    output_len: int = 256
    ttft_p95_ms: float | None = None
    itl_ms: float | None = None
    api: str | None = None  # the hosted API to compare costs with; None: one of the model's class
    max_gpus: int = 64
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    limit: int = 5


@dataclass(frozen=True)
class Layout:
    gpu: str
    gpus: int
    tp: int
    pp: int
    replicas: int
    weights_gib_per_gpu: float
    kv_gib_per_gpu: float
    kv_tokens: int
    max_concurrency: int
    concurrency_per_replica: int
    ttft_ms: float
    ttft_p95_ms: float
    ttft_mean_ms: float
    ttft_streams_ms: float  # of the mean: the API server's work for the other streams in flight
    itl_ms: float
    e2e_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    meets_slo: bool
    overloaded: bool  # its queue grows without bound at this load
    cost: CostReport

    def to_dict(self) -> dict[str, object]:
        data = {k: v for k, v in self.__dict__.items() if k != "cost"}
        data.update(self.cost.to_dict())
        return data


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    model: ModelArch
    quant: Quantization
    context: int
    layouts: list[Layout] = field(default_factory=list)
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return bool(self.layouts)


def plan(request: PlanRequest, catalog: Catalog, efficiency: Efficiency) -> PlanResult:
    model = catalog.models.get(request.model)
    request = replace(request, api=api_for(request, model))
    quant = catalog.quantizations.get(request.quant or model.native_quant or "bf16")
    context = request.context or min(model.max_context, 8192)
    if (refusal := _unplannable(request, model, context)) is not None:
        return PlanResult(request, model, quant, context, reason=refusal)
    # "all" means every GPU class; CPU entries (kept for calibrating the CPU engine) only when named.
    gpus = (
        [g for g in catalog.gpus if g.kind == "gpu"]
        if request.gpu == "all"
        else [catalog.gpus.get(request.gpu)]
    )
    layouts: list[Layout] = []
    misses: list[tuple[float, str]] = []
    for gpu in gpus:
        for tp, pp in _parallel_shapes(gpu, request, model):
            layout = _best_layout(request, catalog, efficiency, model, quant, context, gpu, tp, pp, misses)
            if layout is not None:
                layouts.append(layout)
    # Across GPU classes the price of a token compares them; within one, the month's bill.
    by_token = request.gpu == "all"
    layouts.sort(
        key=lambda lay: (
            not lay.meets_slo,
            lay.cost.cost_per_million_tokens if by_token else lay.cost.monthly_usd,
            lay.ttft_p95_ms,
        )
    )
    if not layouts:
        return PlanResult(request, model, quant, context, reason=_why_nothing(request, misses))
    chosen = layouts[: request.limit]
    if request.has_slo and not chosen[0].meets_slo:
        return PlanResult(request, model, quant, context, chosen, reason=_why_missed(request, chosen[0]))
    if chosen[0].overloaded:  # a rate to keep up with is an objective too, SLOs or not
        closest = max(chosen, key=lambda lay: lay.requests_per_s)
        return PlanResult(request, model, quant, context, chosen, reason=_why_overloaded(request, closest))
    return PlanResult(request, model, quant, context, chosen)


def _unplannable(request: PlanRequest, model: ModelArch, context: int) -> str | None:
    """Why the request cannot be planned at all, or None."""
    if context > model.max_context:
        return f"{model.name} supports at most {model.max_context} tokens of context, not {context}"
    if request.gpus is not None and request.gpus > request.max_gpus:
        return f"{request.gpus} GPUs asked for: more than the largest cluster ({request.max_gpus})"
    if request.input_len + request.output_len > context:
        tokens = f"input ({request.input_len}) + output ({request.output_len}) tokens"
        return f"{tokens} exceed the context ({context})"
    return None


def api_for(request: PlanRequest, model: ModelArch) -> str:
    """The hosted API to compare with: the one asked for, else one serving models of this one's class by
    total parameters (an 8B model against an 8B's price, a 70B against a 70B's; past that, a frontier
    API): hosts price a mixture of experts by its size (gpt-oss-120b, 5B active, is not an 8B's)."""
    if request.api is not None:
        return request.api
    size = model.params_b  # (a mixture of experts is priced as its size, not its active parameters)
    if size <= 20:
        return "together-llama-3.1-8b"
    return "together-llama-3.1-70b" if size <= 120 else "gpt-4o"


def _why_missed(request: PlanRequest, closest: Layout) -> str:
    """No layout meets the objective: which comes closest, and what to try."""
    wanted = []
    if request.ttft_p95_ms is not None:
        wanted.append(f"TTFT p95 ≤ {request.ttft_p95_ms:g} ms")
    if request.itl_ms is not None:
        wanted.append(f"ITL ≤ {request.itl_ms:g} ms")
    return (
        f"no layout meets {' and '.join(wanted)} at this load; the closest is {closest.gpus}× {closest.gpu} "
        f"({closest.tp}×{closest.pp}×{closest.replicas}): TTFT p95 {closest.ttft_p95_ms:,.0f} ms, ITL "
        f"{closest.itl_ms:.1f} ms; try more GPUs (--max-gpus, now {request.max_gpus}), another GPU class "
        "(--gpu all), a lower load, or shorter prompts"
    )


def _why_overloaded(request: PlanRequest, closest: Layout) -> str:
    """No layout keeps up with the request rate: which comes closest, and what to try."""
    within = (
        f"on exactly {request.gpus} GPU(s)"
        if request.gpus is not None
        else f"within {request.max_gpus} GPU(s)"
    )
    return (
        f"no layout {within} keeps up with {request.request_rate:g} requests/s; the closest is "
        f"{closest.gpus}× {closest.gpu} ({closest.tp}×{closest.pp}×{closest.replicas}), which finishes "
        f"{closest.requests_per_s:.3g} requests/s; try more GPUs (--max-gpus), another GPU class "
        "(--gpu all), a lower rate, or shorter prompts and outputs"
    )


def _parallel_shapes(gpu: GPU, request: PlanRequest, model: ModelArch) -> Iterator[tuple[int, int]]:
    for pp in _PP_CHOICES:
        for tp in _TP_CHOICES:
            if tp > gpu.gpus_per_node or tp * pp > request.max_gpus or not tp_splits(model, tp):
                continue
            if request.gpus is not None and request.gpus % (tp * pp):
                continue
            yield tp, pp


def tp_splits(model: ModelArch, tp: int) -> bool:
    """Whether vLLM starts `model` on `tp` ranks: its attention heads split evenly over them (it refuses
    otherwise: Qwen2.5-7B's 28 heads on 8), and its KV heads too, or, fewer than the ranks, each one
    replicated on a whole number of them."""
    if model.heads % tp:
        return False
    return model.kv_heads % tp == 0 if model.kv_heads >= tp else tp % model.kv_heads == 0


def _best_layout(
    request: PlanRequest,
    catalog: Catalog,
    efficiency: Efficiency,
    model: ModelArch,
    quant: Quantization,
    context: int,
    gpu: GPU,
    tp: int,
    pp: int,
    misses: list[tuple[float, str]],
) -> Layout | None:
    kv_bytes = 2.0
    memory = _memory(request, model, quant, gpu, tp, pp, request.gpu_memory_utilization, kv_bytes)
    max_seqs = memory.max_sequences(model, context, tp, pp, kv_bytes)
    if max_seqs < 1:
        need = memory.weights + memory.activation + memory.overhead
        sequence = sequence_kv_bytes(model, context, tp, pp, kv_bytes)
        shortfall = (need + sequence) / memory.budget  # how far from fitting: 1.0 would just fit
        hint = fit_hint(request, model, quant, context, gpu, tp, pp)
        misses.append(
            (
                shortfall,
                f"{gpu.name} TP={tp} PP={pp}: {need / 1e9:.1f} GB of weights and runtime per GPU leave "
                f"{memory.kv_bytes / 1e9:.2f} GB of the {memory.budget / 1e9:.1f} GB budget for KV, "
                f"less than one {context}-token sequence" + (f" ({hint})" if hint else ""),
            )
        )
        return None
    perf = PerfModel(model, gpu, quant, tp=tp, pp=pp, kv_dtype_bytes=kv_bytes, efficiency=efficiency)
    config = SchedulerConfig(
        max_num_seqs=request.max_num_seqs,
        max_num_batched_tokens=request.max_num_batched_tokens,
        num_blocks=memory.kv_tokens // BLOCK_SIZE,
        enable_prefix_caching=False,
    )
    ceiling = math.inf
    if request.request_rate is not None:
        ceiling = saturated_rate(perf, config, request.input_len, request.output_len)
    seen: dict[float, LoadResult] = {}

    def run(share: float) -> LoadResult:
        if share not in seen:
            if request.request_rate is not None:
                seen[share] = open_loop(
                    perf, config, share, request.input_len, request.output_len, ceiling=ceiling
                )
            else:
                seen[share] = closed_loop(perf, config, int(share), request.input_len, request.output_len)
        return seen[share]

    layout = None
    for replicas in _replica_counts(request, tp * pp, ceiling):
        if request.request_rate is not None:  # (arrivals spread evenly)
            share: float = request.request_rate / replicas
            load = run(share)
            groups = [(replicas, load)]
            per_replica = max(1, round(share * load.e2e_mean))  # (Little's law: the mean)
        else:  # clients split as evenly as they go: some replicas hold one more than the rest
            fewer, more = divmod(request.concurrency, replicas)
            share = fewer + (more > 0)
            load = run(share)  # the busiest replicas' latency is the layout's
            groups = [(more or replicas, load)] + ([(replicas - more, run(fewer))] if more and fewer else [])
            per_replica = int(share)
        meets = _meets(request, load)
        layout = _layout(
            request, catalog, gpu, tp, pp, replicas, memory, max_seqs, per_replica, load, groups, meets
        )
        if meets or (request.request_rate is None and share == 1):
            break
    return layout


def _replica_counts(request: PlanRequest, per_replica_gpus: int, ceiling: float) -> range:
    """The replica counts to try, fewest first: the one `--gpus` gives, else from the fewest whose share of
    a request rate is within what a replica keeps up with (`KEEPS_UP` of `ceiling`, its saturated rate;
    fewer are overloaded for sure)."""
    if request.gpus is not None:
        return range(request.gpus // per_replica_gpus, request.gpus // per_replica_gpus + 1)
    most = request.max_gpus // per_replica_gpus
    fewest = 1 if request.request_rate is None else math.ceil(request.request_rate / (KEEPS_UP * ceiling))
    return range(min(max(1, fewest), most), most + 1)


def _meets(request: PlanRequest, load: LoadResult) -> bool:
    """Keeps up with the load and, where SLOs are stated, meets them."""
    if load.overloaded:
        return False
    if request.ttft_p95_ms is not None and load.ttft_p95 * 1000 > request.ttft_p95_ms:
        return False
    return request.itl_ms is None or load.itl_mean * 1000 <= request.itl_ms


def _layout(
    request: PlanRequest,
    catalog: Catalog,
    gpu: GPU,
    tp: int,
    pp: int,
    replicas: int,
    memory: MemoryPlan,
    max_seqs: int,
    per_replica: int,
    load: LoadResult,
    groups: list[tuple[int, LoadResult]],
    meets: bool,
) -> Layout:
    """`load`: the busiest replica's (its latency is the layout's); `groups`: how many replicas carry each
    load (their throughputs add up)."""
    gpus = tp * pp * replicas
    tokens_per_s = sum(count * part.output_tokens_per_s for count, part in groups)
    requests_per_s = sum(count * part.requests_per_s for count, part in groups)
    cost = cost_report(
        gpu.price_per_hour * gpus,
        requests_per_s,
        request.input_len,
        request.output_len,
        catalog.apis.get(request.api or ""),
    )
    return Layout(
        gpu=gpu.name,
        gpus=gpus,
        tp=tp,
        pp=pp,
        replicas=replicas,
        weights_gib_per_gpu=round(memory.weights / 1024**3, 2),
        kv_gib_per_gpu=round(memory.kv_bytes / 1024**3, 2),
        kv_tokens=memory.kv_tokens,
        max_concurrency=max_seqs * replicas,
        concurrency_per_replica=per_replica,
        ttft_ms=round(load.ttft_p50 * 1000, 1),
        ttft_p95_ms=round(load.ttft_p95 * 1000, 1),
        ttft_mean_ms=round(load.ttft_mean * 1000, 1),
        ttft_streams_ms=round(load.streams_s * 1000, 1),
        itl_ms=round(load.itl_mean * 1000, 2),
        e2e_ms=round(load.e2e_p50 * 1000, 1),
        output_tokens_per_s=round(tokens_per_s, 1),
        requests_per_s=round(requests_per_s, 3),
        meets_slo=meets,
        overloaded=load.overloaded,
        cost=cost,
    )


_UTILIZATIONS = (0.92, 0.95)  # vLLM runs at these when asked; beyond, the CUDA context and spikes OOM
_KV_DTYPES = ((2.0, "auto"), (1.0, "fp8"))


def fit_hint(
    request: PlanRequest,
    model: ModelArch,
    quant: Quantization,
    context: int,
    gpu: GPU,
    tp: int,
    pp: int,
) -> str | None:
    """The smallest change of vLLM's settings that makes a layout hold the model: a higher
    gpu_memory_utilization first, then a shorter max_model_len (never below the workload's input +
    output), then an fp8 KV cache; None when none does."""
    floor = request.input_len + request.output_len
    lengths = [context] + [n for n in (6144, 4096, 3072, 2048, 1024) if floor <= n < context]
    for kv_bytes, kv_name in _KV_DTYPES:
        for length in lengths:
            for utilization in (request.gpu_memory_utilization, *_UTILIZATIONS):
                if (utilization, length, kv_bytes) == (request.gpu_memory_utilization, context, 2.0):
                    continue  # the defaults: already found not to fit
                memory = _memory(request, model, quant, gpu, tp, pp, utilization, kv_bytes)
                sequences = memory.max_sequences(model, length, tp, pp, kv_bytes)
                if sequences < 1:
                    continue
                changes = (
                    [f"gpu_memory_utilization {utilization:g}"]
                    if utilization != request.gpu_memory_utilization
                    else []
                )
                changes += [f"max_model_len ≤ {length}"] if length != context else []
                changes += [f"kv_cache_dtype {kv_name}"] if kv_bytes != 2.0 else []
                workload = memory.max_sequences(model, floor, tp, pp, kv_bytes)
                return (
                    f"fits at {' with '.join(changes)}: {memory.kv_bytes / 2**30:.1f} GiB KV per GPU, "
                    f"{workload} concurrent {floor}-token sequences"
                )
    return None


def _memory(
    request: PlanRequest,
    model: ModelArch,
    quant: Quantization,
    gpu: GPU,
    tp: int,
    pp: int,
    utilization: float,
    kv_bytes: float,
) -> MemoryPlan:
    """One GPU's memory for a layout, with the request's scheduler limits."""
    return memory_plan(
        model,
        gpu,
        quant,
        tp=tp,
        pp=pp,
        gpu_memory_utilization=utilization,
        kv_dtype_bytes=kv_bytes,
        max_num_batched_tokens=request.max_num_batched_tokens,
        max_num_seqs=request.max_num_seqs,
    )


def _why_nothing(request: PlanRequest, misses: list[tuple[float, str]]) -> str:
    """Why nothing fits, with the three layouts that came closest."""
    if request.gpus is not None:
        head = f"no layout on exactly {request.gpus} GPU(s) of the chosen type holds the model"
    else:
        head = f"no layout within {request.max_gpus} GPUs holds the model"
    closest = [text for _, text in sorted(misses)[:3]]
    return f"{head}; closest: {'; '.join(closest)}" if closest else head
