"""Benchmark workloads: what each request asks.

- random: prompts of a fixed (or uniformly ranged) number of common one-token words, fixed output length;
- sharegpt: conversations from a ShareGPT-format JSON file (first human turn → prompt, the reply's length
  → output length, as vLLM's benchmark does);
- shared-prefix: tenants, each with a long shared system prompt (or document) and multi-turn chats that
  grow: the case where prefix-aware routing matters.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchRequest", "random_requests", "shared_prefix_requests", "sharegpt_requests"]

# Short, common English words: one token each in the usual BPE vocabularies (with their leading space).
_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request: chat messages (or a plain prompt), the output length asked, and who sends it."""

    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | None = None
    output_len: int = 128
    expected_input_len: int | None = None
    tenant: str | None = None

    def body(self, model: str, ignore_eos: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.prompt is not None:
            body["prompt"] = self.prompt
        else:
            body["messages"] = self.messages
        if self.tenant:
            body["user"] = self.tenant
        if ignore_eos:
            body["ignore_eos"] = True
        return body


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def random_requests(
    count: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0, chat: bool = False
) -> list[BenchRequest]:
    """Lengths uniform in [len·(1−r), len·(1+r)] (r = range_ratio; 0 = fixed), like vLLM's random dataset."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n_in = max(1, round(input_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        n_out = max(1, round(output_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        text = _words(rng, n_in)
        if chat:
            out.append(
                BenchRequest(
                    messages=[{"role": "user", "content": text}], output_len=n_out, expected_input_len=n_in
                )
            )
        else:
            out.append(BenchRequest(prompt=text, output_len=n_out, expected_input_len=n_in))
    return out


def sharegpt_requests(
    path: Path, count: int, seed: int = 0, max_output: int = 1024, chat: bool = True
) -> list[BenchRequest]:
    """Conversations from a ShareGPT JSON file: [{"conversations": [{"from": "human", "value": …}, …]}, …]:
    the first turn as a chat message, or (`chat` false, for /v1/completions) as the prompt's text."""
    data = json.loads(path.read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        if not prompt:
            continue
        output_len = max(4, min(max_output, len(reply.split()) * 4 // 3))
        if chat:
            out.append(BenchRequest(messages=[{"role": "user", "content": prompt}], output_len=output_len))
        else:
            out.append(BenchRequest(prompt=prompt, output_len=output_len))
        if len(out) == count:
            break
    if not out:
        raise ValueError(f"{path} holds no usable ShareGPT conversations")
    return out


def shared_prefix_requests(
    count: int,
    tenants: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    turns: int = 3,
    seed: int = 0,
) -> list[BenchRequest]:
    """Each tenant has a long shared system prompt; each chat grows over `turns` turns (history resent)."""
    rng = random.Random(seed)
    prefixes = [f"You are assistant {t}. " + _words(rng, prefix_len) for t in range(tenants)]
    out: list[BenchRequest] = []
    while len(out) < count:
        tenant = rng.randrange(tenants)
        history: list[dict[str, str]] = [{"role": "system", "content": prefixes[tenant]}]
        for _ in range(turns):
            history = [*history, {"role": "user", "content": _words(rng, question_len)}]
            out.append(BenchRequest(messages=list(history), output_len=output_len, tenant=f"tenant-{tenant}"))
            history = [*history, {"role": "assistant", "content": _words(rng, output_len)}]
            if len(out) == count:
                break
    rng.shuffle(out)
    return out
