"""What a finished request is recorded as: its metrics and its usage row, with the tokens charged for it
where its engine told none (`reserved_usage`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from corral.admission import Principal
from corral.gateway.context import RequestContext
from corral.gateway.metrics import GatewayMetrics
from corral.gateway.usage import UsageRecorder
from corral.store import UsageRecord

__all__ = ["APIS", "Accounting", "reserved_usage"]

# the client API a request's path is (a dialect's requests say their own)
APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


class Accounting:
    """Records finished requests in the gateway's metrics and its usage store."""

    def __init__(self, metrics: GatewayMetrics, usage: UsageRecorder) -> None:
        self._metrics, self._usage = metrics, usage

    def record(self, ctx: RequestContext, principal: Principal, status: int) -> None:
        """`ctx`'s request finished with `status`: its metrics, and its usage row (to be written)."""
        usage = ctx.usage or {}
        now = time.monotonic()
        latency = now - ctx.received_at
        ttft = ctx.first_byte_at - ctx.received_at if ctx.first_byte_at is not None else None
        input_tokens = int(usage.get("prompt_tokens") or 0)
        output_tokens = int(usage.get("completion_tokens") or 0)
        model = ctx.model
        m = self._metrics.of(model)
        m.finished(status, latency)
        state = ctx.headers.get("x-corral-cache")
        if state is not None:
            self._metrics.cache_lookups.labels(
                model, self._metrics.tenant_label(principal.tenant), state
            ).inc()
        if ctx.cached:  # no engine tokens; usage keeps what the hit was charged, under replica "cache"
            charged = ctx.charged
            input_tokens, output_tokens = (input_tokens, output_tokens) if charged else (0, 0)
            ttft = None  # a hit's sub-millisecond answer says nothing of the engines (SLO alerts)
        self._metrics.tenant(principal.tenant).finished(status, input_tokens, output_tokens)
        api = ctx.exchange.api if ctx.exchange is not None else APIS.get(ctx.path, "chat")
        self._metrics.api_finished(api, status)
        if status < 400 and not ctx.cached:
            m.input_tokens.inc(input_tokens)
            m.output_tokens.inc(output_tokens)
        if ctx.held:
            m.prefill_holds.inc()
            m.prefill_hold_seconds.inc(ctx.held)
        if ttft is not None:
            m.ttft.observe(ttft)
            each = output_tokens / max(1, ctx.route.sequences)  # (n choices generated side by side)
            if each > 1:
                m.itl.observe((latency - ttft) / (each - 1))
        self._usage.record(
            UsageRecord(
                at=datetime.now(UTC),
                key_id=principal.key_id,
                tenant=principal.tenant,
                model=model,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
                latency_ms=round(latency * 1000, 2),
                status=status,
                replica="cache" if ctx.cached else (ctx.replica.id if ctx.replica else None),
                api=api,
                request_id=ctx.request_id,
            )
        )


def reserved_usage(ctx: RequestContext, whole: bool = False) -> dict[str, int]:
    """The usage a request is charged where its engine told none: its reservation at admission, its
    prompt's estimate and the most output it asked for (without max_tokens, the gateway's estimate), or
    the reads of events its stream relayed where more (about a token each: an open-ended stream the client
    leaves is charged for what it read). `whole`: the engine generated all of the answer, which the gateway
    did not take (larger than it relays whole): charged all its monthly budget reserved, without
    max_tokens all the model may generate."""
    prompt = ctx.route.prompt_tokens
    reserved = ctx.budget_tokens if whole and ctx.budget_tokens else ctx.route.tokens
    completion = max(reserved - prompt, ctx.relayed)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
