"""An engine's own load figures, read from its metrics (and KV-cache events) into one common shape."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

__all__ = ["EngineLoad"]

# What an engine's figures may say at most. Any engine corral scrapes writes them (an `external` server, a
# KV-event publisher of its own), routing weighs them, and the supervisor sends them to its gateway
# workers as JSON: a figure past these is no engine's, and one past 2^64 could not be sent at all.
_MOST_REQUESTS = 1_000_000  # requests running or waiting (vLLM's --max-num-seqs is a few hundred)
_MOST_KV_TOKENS = 2**40  # tokens of KV cache (a terabyte of it at a byte a token)
_MOST_TOTAL = 2**53  # counters: the integers a float (and JSON's readers) hold exactly
_MOST_SECONDS = 86_400.0  # an engine's mean time to a first token, or between tokens
_CLOCK_SLACK_S = 60.0  # how far ahead of this host's clock an engine's KV-event times may be


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine's own load figures, in a shape common to all engines. Each figure is
    bounded as the load is made (see `__post_init__`), whichever engine said it."""

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
    scraped_at: float = field(default_factory=time.time)  # (wall clock: when, as people read it)
    # when it was read, on this host's monotonic clock: how old it is (`Supervisor.fresh_load`, a drain's
    # wait for an idle engine) whatever the wall clock does meanwhile (NTP stepping it back an hour made a
    # reading ten minutes old pass for fresh). Gateway workers run on the same host: the same clock.
    scraped_monotonic: float = field(default_factory=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        """Each figure finite, not negative and within what an engine can mean: a queue of -1,000,000 drew
        every request to its replica (its load always the least), a cache of 2^64 tokens could not be sent
        to the gateway workers, and a KV event stamped +inf reached them as null (every prefix-routed
        request then failed). Figures past the bounds are taken at the bound; a time or a share that is no
        number, as unknown."""
        put = object.__setattr__  # (frozen: set once, here, as the load is made)
        put(self, "running", int(_within(self.running, _MOST_REQUESTS)))
        put(self, "waiting", int(_within(self.waiting, _MOST_REQUESTS)))
        put(self, "kv_usage", _known(self.kv_usage, 1.0))
        for name in _TOTALS:
            put(self, name, float(_within(getattr(self, name), _MOST_TOTAL)))
        put(self, "ttft_mean_s", _known(self.ttft_mean_s, _MOST_SECONDS))
        put(self, "itl_mean_s", _known(self.itl_mean_s, _MOST_SECONDS))
        put(self, "kv_capacity_tokens", int(_within(self.kv_capacity_tokens or 0, _MOST_KV_TOKENS)) or None)
        cached = self.kv_cached_tokens
        put(self, "kv_cached_tokens", int(_within(cached, _MOST_KV_TOKENS)) if cached is not None else None)
        put(self, "kv_evicted_tokens_total", int(_within(self.kv_evicted_tokens_total, _MOST_TOTAL)))
        put(self, "kv_cleared_total", int(_within(self.kv_cleared_total, _MOST_TOTAL)))
        # (an eviction frontier ahead of now would make the prefix index forget blocks recorded from now on)
        put(self, "kv_evicted_through", float(_within(self.kv_evicted_through, time.time() + _CLOCK_SLACK_S)))


_TOTALS = (
    "prompt_tokens_total",
    "generated_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "preemptions_total",
)


def _within(value: float, most: float) -> float:
    """`value` in [0, most]: NaN and less than 0 as 0, +inf and more than `most` as `most`."""
    return min(value, most) if value > 0 else 0


def _known(value: float | None, most: float) -> float | None:
    """An optional share or time in [0, most]; None where it is no finite number."""
    if value is None or not math.isfinite(value):
        return None
    return float(_within(value, most))
