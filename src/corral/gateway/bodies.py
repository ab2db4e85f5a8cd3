"""Request bodies: read against a deadline, and rewritten for the engine.

A client that sends its headers and then stalls holds a connection and a handler; every route with a body
reads it through here (`gateway.body_timeout`): a whole body within the timeout of its headers, an
upload's parts each within it of the last (an idle timeout, so a large file on a slow link still arrives).
A body the gateway adds a member to (`stream_options`, `cache_salt`) is rewritten with `with_member`,
without parsing a long prompt where the body does not name the member yet."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from corral.protocol import InvalidRequest, PayloadTooLarge, RequestTimeout

__all__ = ["read_body", "with_member", "within"]

_T = TypeVar("_T")


async def read_body(request: web.Request, deadline_s: float, max_bytes: int) -> bytes:
    """The whole body: 413 past `max_bytes`, 408 when it has not arrived within `deadline_s`."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    try:
        if request.content.is_eof():  # the body came with the headers (most requests): no timer needed
            return await request.read()
        async with asyncio.timeout(deadline_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _too_large(max_bytes) from exc
    except TimeoutError as exc:
        raise RequestTimeout(
            f"The request body did not arrive within {deadline_s:g} s of its headers."
        ) from exc


async def within(step: Awaitable[_T], idle_s: float) -> _T:
    """One step of reading a body (an upload's next part or chunk); 408 when the client is silent longer
    than `idle_s`."""
    try:
        async with asyncio.timeout(idle_s):
            return await step
    except TimeoutError as exc:
        raise RequestTimeout(f"The upload stalled: nothing arrived for {idle_s:g} s.") from exc


def with_member(raw: bytes, name: str, value: Any, member: bytes, merge: bool = False) -> bytes:
    """The JSON object `raw` (a body pydantic accepted) with `name` set to `value`. Where the bytes do not
    name it, `member` (the pre-encoded `,"name":value`) is appended before the closing brace, with no parse;
    else the body is parsed and re-serialised, `value` merged into a dict already there with `merge`, else
    replacing it (a client's own `cache_salt` never reaches the engine)."""
    if b'"' + name.encode() + b'"' not in raw:
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + member + b"}"
    try:  # (the standard library keeps integers past 64 bits, which orjson would turn into floats)
        data: dict[str, Any] = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:  # NaN, Infinity: pydantic's parser took them, JSON has none
        raise InvalidRequest(f"The body is not valid JSON: {exc}.") from exc
    old = data.get(name)
    data[name] = {**old, **value} if merge and isinstance(old, dict) else value
    return json.dumps(data, separators=(",", ":")).encode()  # (ASCII: a lone surrogate stays escaped)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")
