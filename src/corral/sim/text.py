"""Deterministic stand-ins for a tokenizer and for generated text.

Tokens are words and punctuation marks (about 1.3 times fewer than a BPE tokenizer would count), each
mapped to a stable id, so equal prompt prefixes give equal token blocks and hit the prefix cache. Output
words come from a seeded generator: the same seed and prompt give the same text.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterable

__all__ = ["TextGenerator", "chat_prompt", "tokenize"]

_PIECES = re.compile(r"\w+|[^\w\s]")
_WORDS = (
    "the of and to in is that it for on with as was at by be this from or have an are not but which one all "
    "were when we there can more if will about out up so what time has into some them these could other than "
    "then now only its two new way may first any work where after most over well also back use good make "
    "model token cluster river light stone green quiet north water small early music paper world city field"
).split()


def tokenize(text: str, vocab: int = 32000) -> list[int]:
    return [zlib.crc32(piece.encode()) % vocab for piece in _PIECES.findall(text)]


def chat_prompt(messages: Iterable[dict[str, object]]) -> str:
    """A chat rendered to one prompt string, with role markers like a chat template adds."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{message.get('role', 'user')}|> {content or ''}")
    parts.append("<|assistant|>")
    return "\n".join(parts)


class TextGenerator:
    """One word per generated token."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def next_word(self, first: bool) -> str:
        word = self._rng.choice(_WORDS)
        return word.capitalize() if first else " " + word
