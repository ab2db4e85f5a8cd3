"""The typed context one request carries through the pipeline's stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from corral.admission import BudgetHold
from corral.dialects.chat import Exchange
from corral.engines import EngineFeatures
from corral.gateway.toolcalls import ToolEmulation
from corral.protocol import EmbeddingRequest, GenerationRequest
from corral.routing import Replica, RouteRequest

__all__ = ["RequestContext"]


@dataclass(slots=True)
class RequestContext:
    """What the stages know about one generation request; stages fill in their part."""

    path: str
    body: GenerationRequest | EmbeddingRequest
    upstream_body: bytes
    received_at: float
    route: RouteRequest
    replica: Replica | None = None
    first_byte_at: float | None = None
    held: float = 0.0  # seconds held for another request's prefill of the same prefix (prefill coalescing)
    usage: dict[str, Any] | None = None
    relayed: int = 0  # a stream's reads of events sent on (about a token each): charged if usage never came
    shares: int = 1  # the whole answers its answer is made of (a fan-out's parts), which share one bound
    client_gone: bool = False  # the client disconnected before the whole answer was written
    delivered: bool = False  # a stream's every event is written (only its closing chunk may be left)
    features: EngineFeatures = field(default_factory=EngineFeatures)  # what the model's engine does right
    fanout: bool = False  # the gateway answers it with several single-choice engine requests
    failover: bool = False  # a stream cut after its first byte may be continued on another replica
    replica_failed: bool = False  # its replica failed mid-answer (told to the circuit breaker)
    replica_silent: bool = False  # ... by going silent (a stall or read timeout: never its tenant's doing)
    headers: dict[str, str] = field(default_factory=dict)  # extra response headers (x-corral-cache)
    written: list[bytes] | None = None  # a stream's events as written, kept for the cache when set
    whole: bytes | None = None  # a whole answer's body, kept for the cache when `written` is set
    complete: bool = False  # the stream ended well on its first replica (a cache may keep it)
    cached: bool = False  # answered from the cache
    charged: bool = True  # a cache hit counts its tokens against limits, budgets and usage
    limiter: Any = None  # the limiter that reserved its budget (settled by the same one)
    above_reserved: Any = None  # reservations against the limits above its key (its makers', its adapter's)
    budgeted: BudgetHold | None = None  # reserved of its key's monthly budget (released when it settles)
    # what a monthly budget reserves (None: route.tokens): without max_tokens, all the engine may generate
    budget_tokens: int | None = None
    lookup: Any = None  # its dealings with the response cache (cache.CacheLookup), when it has some
    exchange: Exchange | None = None  # asked in another dialect (Responses, Messages): told back in it
    emulation: ToolEmulation | None = None  # tool calls its engine cannot make, asked as JSON
    request_id: str | None = None  # its x-request-id (clients.py), or its batch output line's
    trace: bytes = b""  # the client's W3C trace context, as header lines for the engine (clients.py)

    @property
    def model(self) -> str:
        return self.body.model

    @property
    def to_engine(self) -> bytes:
        """Header lines for the engine: the request's id (vLLM names the request by it in its log and its
        answer; letters, digits and ._:- only) and the client's trace context."""
        named = b"X-Request-Id: " + self.request_id.encode() + b"\r\n" if self.request_id else b""
        return named + self.trace

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def client_wants_usage(self) -> bool:
        return self.body.include_usage
