"""The golden eval gate: a candidate replica answers the spec's golden prompts right before it serves.

First a warm-up request must succeed (it also warms the engine: a first request's one-time costs are not
held to the latency bound): a one-token chat request, or for an embedding model (which serves
`/v1/embeddings` alone) the embedding of one word, which must come back as a non-empty vector of finite
numbers. Then each case goes straight to the candidate (not through the router, where it has no traffic
yet) as a temperature-0 chat request; its answer must pass the case's one check, and arrive within the
rollout's `eval_latency_s` when that is set. The cases check text, so an embedding model has none (an
apply refuses them); a replica asked them anyway fails. A replica that cannot answer at all fails the gate
too, and so does a check that cannot be carried out (the spec checks each at load, so that is a bug),
with what went wrong: the gate's answer is always a verdict, never an exception.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from typing import Any

import aiohttp
import jsonschema

from corral.config import EvalCase
from corral.routing import Replica

__all__ = ["check_answer", "run_gate"]

logger = logging.getLogger(__name__)

_WARM_UP = "warm-up"


class _NoAnswer(Exception):
    """The replica did not answer a request of the gate with one it can be judged by."""


async def run_gate(
    session: aiohttp.ClientSession,
    replica: Replica,
    cases: list[EvalCase],
    latency_s: float | None,
    timeout_s: float = 120.0,
    model: str | None = None,
) -> str | None:
    """None when `replica` passes every case (asked as `model`: its own, or a LoRA adapter it loaded);
    else why it failed, in one line."""
    ask = _Asker(session, replica, timeout_s)
    name = model or replica.model
    if replica.features.embeddings:
        if cases:
            return (
                f"golden eval: {replica.id} is an embedding model: its answers are vectors, which "
                "golden_eval cases (checks of text) cannot judge"
            )
        try:
            await ask.embedding(name)
        except _NoAnswer as exc:
            return f"golden eval {_WARM_UP!r}: {exc}"
        return None
    try:
        await ask.chat(name, [{"role": "user", "content": "Hello"}], max_tokens=1)
    except _NoAnswer as exc:
        return f"golden eval {_WARM_UP!r}: {exc}"
    for case in cases:
        problem = await _judge(ask, name, case, latency_s)
        if problem is not None:
            return f"golden eval {case.label!r}: {problem}"
    return None


async def _judge(ask: _Asker, name: str, case: EvalCase, latency_s: float | None) -> str | None:
    """What is wrong with the replica's answer to `case`, or None."""
    messages = case.messages or [{"role": "user", "content": case.prompt}]
    started = time.monotonic()
    try:
        answer = await ask.chat(name, messages, case.max_tokens)
    except _NoAnswer as exc:
        return str(exc)
    took = time.monotonic() - started
    try:
        problem = check_answer(case, answer)
    except Exception as exc:  # a check that cannot run fails the gate with its reason, not the rollout
        logger.exception("golden eval %r: the check could not be carried out", case.label)
        return f"the check could not be carried out ({type(exc).__name__}: {exc})"
    if problem is not None:
        return problem
    if latency_s is not None and took > latency_s:
        return f"answered in {took:.2f}s, over the {latency_s:g}s limit"
    return None


class _Asker:
    """Sends the gate's requests straight to one replica, with its engine's key."""

    def __init__(self, session: aiohttp.ClientSession, replica: Replica, timeout_s: float) -> None:
        self._session = session
        self._url = replica.url
        self._headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def chat(self, model: str, messages: list[dict[str, Any]], max_tokens: int) -> str:
        """The text of a temperature-0 chat answer."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        answer = await self._post("/v1/chat/completions", body)
        try:
            text = answer["choices"][0]["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise _NoAnswer(f"no answer ({type(exc).__name__}: {exc})") from exc
        if not isinstance(text, str):
            raise _NoAnswer(f"no answer (its content is not text: {str(text)[:80]})")
        return text

    async def embedding(self, model: str) -> None:
        """Embed one word; _NoAnswer unless the vector is a non-empty list of finite numbers."""
        answer = await self._post("/v1/embeddings", {"model": model, "input": "Hello"})
        try:
            vector = answer["data"][0]["embedding"]
        except (KeyError, IndexError, TypeError) as exc:
            raise _NoAnswer(f"no embedding in the answer ({type(exc).__name__}: {exc})") from exc
        if not isinstance(vector, list) or not vector:
            raise _NoAnswer(f"the embedding is not a non-empty vector: {str(vector)[:80]}")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in vector):
            raise _NoAnswer(f"the embedding of {len(vector)} values holds some that are not finite numbers")

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            async with self._session.post(
                self._url + path, json=body, headers=self._headers, timeout=self._timeout
            ) as response:
                status = response.status
                answer = await response.json() if status == 200 else None
        except Exception as exc:  # no answer, or not JSON: the candidate fails the gate, saying why
            raise _NoAnswer(f"no answer ({type(exc).__name__}: {exc})") from exc
        if status != 200:
            raise _NoAnswer(f"the replica answered {status}")
        return answer


def check_answer(case: EvalCase, answer: str) -> str | None:
    """None when `answer` passes the case's check; else what was wrong."""
    shown = answer if len(answer) <= 80 else answer[:77] + "..."
    if case.exact is not None and answer.strip() != case.exact.strip():
        return f"expected exactly {case.exact!r}, got {shown!r}"
    if case.contains is not None and case.contains not in answer:
        return f"expected the answer to contain {case.contains!r}, got {shown!r}"
    if case.regex is not None and re.search(case.regex, answer) is None:
        return f"expected a match of /{case.regex}/, got {shown!r}"
    if case.json_schema is not None:
        try:
            jsonschema.validate(json.loads(answer), case.json_schema)
        except json.JSONDecodeError:
            return f"expected JSON, got {shown!r}"
        except jsonschema.ValidationError as exc:
            return f"the JSON answer does not match the schema: {exc.message}"
    return None
