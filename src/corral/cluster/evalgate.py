"""The golden eval gate: a candidate replica answers the spec's golden prompts right before it serves.

First a one-token warm-up request must succeed (it also warms the engine: a first request's one-time costs
are not held to the latency bound). Then each case goes straight to the candidate (not through the router,
where it has no traffic yet) as a temperature-0 chat request; its answer must pass the case's one check,
and arrive within the rollout's `eval_latency_s` when that is set. A replica that cannot answer at all
fails the gate too.
"""

from __future__ import annotations

import json
import re
import time

import aiohttp
import jsonschema

from corral.config import EvalCase
from corral.routing import Replica

__all__ = ["check_answer", "run_gate"]


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
    headers = {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
    warmup = EvalCase(name="warm-up", prompt="Hello", max_tokens=1, regex="")
    for case in [warmup, *cases]:
        messages = case.messages or [{"role": "user", "content": case.prompt}]
        body = {
            "model": model or replica.model,
            "messages": messages,
            "max_tokens": case.max_tokens,
            "temperature": 0,
        }
        started = time.monotonic()
        try:
            async with session.post(
                replica.url + "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status != 200:
                    return f"golden eval {case.label!r}: the replica answered {response.status}"
                answer = (await response.json())["choices"][0]["message"].get("content") or ""
        except Exception as exc:  # no answer, or one of another shape: the candidate fails the gate
            return f"golden eval {case.label!r}: no answer ({type(exc).__name__}: {exc})"
        took = time.monotonic() - started
        problem = check_answer(case, answer)
        if problem is not None:
            return f"golden eval {case.label!r}: {problem}"
        if latency_s is not None and took > latency_s and case is not warmup:
            return f"golden eval {case.label!r}: answered in {took:.2f}s, over the {latency_s:g}s limit"
    return None


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
