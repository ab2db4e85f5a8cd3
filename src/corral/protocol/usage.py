"""An engine's `usage` as the gateway counts it. Engines are other processes (an `external` one is anyone's
server): what they report is read, not trusted. A count that is not a whole number from 0 to MOST_TOKENS
(a string, a negative, 2**70, NaN, true) would stop a request's settling part way (its concurrency slot
and budget hold never given back), credit a key with tokens or write a row no column holds."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["MOST_TOKENS", "engine_usage", "usage_of_answer"]

MOST_TOKENS = 2**31 - 1  # a request's tokens at most: what a usage row's columns hold
_USAGE_KEY = b'"usage"'
_BACKSLASH = ord("\\")
_DETAILS = (("prompt_tokens_details", "cached_tokens"), ("completion_tokens_details", "reasoning_tokens"))


def engine_usage(value: Any) -> dict[str, Any] | None:
    """`value`, an engine's usage object, with its counts checked: the prompt's and completion's tokens
    (an absent or null one is 0), their total (the parts' sum where it says less or is no count), and the
    cached and reasoning tokens where they are counts; None where it is no object or the prompt's or the
    completion's count is not a whole number from 0 to MOST_TOKENS (the request is then charged at its
    reservation, as when an engine reports nothing)."""
    if not isinstance(value, dict):
        return None
    prompt, completion = _count(value.get("prompt_tokens")), _count(value.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    total = _count(value.get("total_tokens"))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total if total is not None and total >= prompt + completion else prompt + completion,
    }
    for name, field in _DETAILS:
        details = value.get(name)
        count = _count(details.get(field)) if isinstance(details, dict) else None
        if count:
            usage[name] = {field: count}
    return usage


def _count(value: Any) -> int | None:
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():  # (1e3: a count; inf and NaN are not integers)
        value = int(value)
    if value.__class__ is int and 0 <= value <= MOST_TOKENS:  # (not bool, a subclass of int)
        return int(value)
    return None


def usage_of_answer(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a JSON answer, checked (engine_usage; None if it has none or is not JSON).
    Engines write it as the answer's last member: then only that slice is parsed (it parses, with the
    object's closing brace cut off, only if it is the last member of the outer object); anything else
    parses the whole body."""
    at = body.rfind(_USAGE_KEY)
    if at > 0 and body[at - 1] != _BACKSLASH:  # (within a string its quotes would be escaped)
        tail = body[at + len(_USAGE_KEY) :].lstrip()
        if tail.startswith(b":"):
            value = tail[1:].rstrip()
            if value.endswith(b"}"):
                try:
                    usage = orjson.loads(value[:-1])
                except orjson.JSONDecodeError:
                    usage = None
                if isinstance(usage, dict):
                    return engine_usage(usage)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return engine_usage(data.get("usage")) if isinstance(data, dict) else None
