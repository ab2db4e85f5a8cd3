"""An engine's own load figures, read from its metrics (and KV-cache events) into one common shape."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["EngineLoad"]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine's own load figures, in a shape common to all engines."""

    running: int
    waiting: int
    kv_usage: float | None = None
    prompt_tokens_total: float = 0.0
    generated_tokens_total: float = 0.0
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0
    preemptions_total: float = 0.0
    ttft_mean_s: float | None = None  # the engine's own time-to-first-token, averaged since it started
    itl_mean_s: float | None = None  # likewise, time between output tokens
    kv_capacity_tokens: int | None = None  # tokens its KV cache holds (vLLM's cache_config_info), if known
    # by the engine's KV-cache events, where followed (engines/kv_events.py); None: not followed
    kv_cached_tokens: int | None = None  # tokens in the blocks its prefix cache holds now
    kv_evicted_tokens_total: int = 0  # tokens of cached blocks it has evicted
    # it has evicted a block it cached at this time (wall clock): it has evicted every block freed before
    kv_evicted_through: float = 0.0
    kv_cleared_total: int = 0  # times its cache was emptied (a reset, a restart)
    scraped_at: float = field(default_factory=time.time)
