"""The golden eval gate: a candidate replica answers the spec's golden prompts right before it serves.

First a warm-up request must succeed (it also warms the engine: a first request's one-time costs are not
held to the latency bound): a one-token chat request, or for an embedding model (which serves
`/v1/embeddings` alone) the embedding of one word, which must come back as a non-empty vector of finite
numbers. Then each case goes straight to the candidate (not through the router, where it has no traffic
yet) as a temperature-0 chat request; its answer must pass the case's one check, and arrive within the
rollout's `eval_latency_s` when that is set. The cases check text, so an embedding model has none (an
apply refuses them); a replica asked them anyway fails. A replica that cannot answer at all fails the gate
too, and so does a check that cannot be carried out (the spec checks each at load, so that is a bug),
with what went wrong: the gate's answer is always a verdict, never an exception. A request waits for its
answer at most a little past the rollout's `eval_latency_s` (a case's: a later answer fails anyway) or, for
the warm-up and where no latency bound is set, its `ready_timeout_s`; the verdict names the limit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from typing import Any

import aiohttp
import jsonschema

from corral.cluster.changes import adapter_digest
from corral.config import AdapterSpec, EvalCase, RolloutSpec
from corral.routing import Replica

__all__ = ["check_answer", "gate_adapter", "gate_timeout", "run_gate"]

logger = logging.getLogger(__name__)

_WARM_UP = "warm-up"
_LATE_S = 5.0  # how long past its latency bound a case's answer is waited for (then: no answer)


class _NoAnswer(Exception):
    """The replica did not answer a request of the gate with one it can be judged by."""


async def run_gate(
    session: aiohttp.ClientSession,
    replica: Replica,
    cases: list[EvalCase],
    latency_s: float | None,
    timeout_s: float = 120.0,
    model: str | None = None,
    timeout_name: str = "the gate's timeout",
) -> str | None:
    """None when `replica` passes every case (asked as `model`: its own, or a LoRA adapter it loaded);
    else why it failed, in one line. A request waits `timeout_s` at most (`timeout_name` says what set it),
    a case's no longer than `latency_s`, its bound."""
    ask = _Asker(session, replica, timeout_s, timeout_name)
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
        answer = await ask.chat(name, messages, case.max_tokens, latency_s)
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

    def __init__(
        self, session: aiohttp.ClientSession, replica: Replica, timeout_s: float, timeout_name: str
    ) -> None:
        self._session = session
        self._url = replica.url
        self._headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
        self._limit = (timeout_s, timeout_name)

    async def chat(
        self, model: str, messages: list[dict[str, Any]], max_tokens: int, latency_s: float | None = None
    ) -> str:
        """The text of a temperature-0 chat answer; a case's (bound by `latency_s`) is waited for a little
        past its bound (a late answer is told apart from none), and no longer."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        within = self._limit
        if latency_s is not None and latency_s + _LATE_S < self._limit[0]:
            within = (latency_s + _LATE_S, f"over the {latency_s:g}s limit: the rollout's eval_latency_s")
        answer = await self._post("/v1/chat/completions", body, within)
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

    async def _post(self, path: str, body: dict[str, Any], within: tuple[float, str] | None = None) -> Any:
        seconds, limit = within or self._limit
        try:
            async with self._session.post(
                self._url + path,
                json=body,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=seconds),
            ) as response:
                status = response.status
                answer = await response.json() if status == 200 else None
        except TimeoutError as exc:
            raise _NoAnswer(f"no answer within {seconds:g}s ({limit})") from exc
        except Exception as exc:  # no answer, or not JSON: the candidate fails the gate, saying why
            raise _NoAnswer(f"no answer ({type(exc).__name__}: {exc})") from exc
        if status != 200:
            raise _NoAnswer(f"the replica answered {status}")
        return answer


_ADAPTER_GATE_S = 120.0  # a replacing adapter's gate request waits at most this (the apply waits for it)


async def gate_adapter(
    session: aiohttp.ClientSession,
    replica: Replica,
    adapter: AdapterSpec,
    path: str,
    rollout: RolloutSpec,
    most_s: float = _ADAPTER_GATE_S,
) -> str | None:
    """The golden eval of a replacing adapter, loaded on `replica` as `name@digest.check` (the digest of the
    files at `path` too: a revision changed in place is a name of its own) and unloaded after: None when it
    passes, else why not. Each request waits the rollout's limit, `most_s` at most: the apply waits for
    the gate, holding every other apply back."""
    name = f"{adapter.name}@{adapter_digest(adapter, path)}.check"
    headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
    seconds, limit = gate_timeout(rollout)
    if seconds > most_s:
        seconds, limit = most_s, f"an adapter's gate at most ({most_s:g} s)"
    timeout = aiohttp.ClientTimeout(total=seconds)
    url = replica.url + "/v1/load_lora_adapter"
    body = {"lora_name": name, "lora_path": path}
    try:
        async with session.post(url, json=body, headers=headers, timeout=timeout) as answer:
            if answer.status != 200:
                return f"the replica could not load it ({answer.status}: {(await answer.text())[:200]})"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"the replica could not load it ({type(exc).__name__} within {seconds:g}s ({limit}): {exc})"
    try:
        cases, latency = rollout.golden_eval, rollout.eval_latency_s
        return await run_gate(session, replica, cases, latency, seconds, model=name, timeout_name=limit)
    finally:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            unload = replica.url + "/v1/unload_lora_adapter"
            async with session.post(unload, json={"lora_name": name}, headers=headers, timeout=timeout):
                pass


def gate_timeout(rollout: RolloutSpec) -> tuple[float, str]:
    """How long one of the gate's requests may wait for its answer, and what says so: the rollout's
    `ready_timeout_s` (a case's wait is bounded by `eval_latency_s` too, where set)."""
    return rollout.ready_timeout_s, "the rollout's ready_timeout_s"


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
