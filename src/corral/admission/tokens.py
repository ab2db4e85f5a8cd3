"""Counting a request's input tokens for rate limits: with the model's own tokenizer when the spec names
one (`models[].tokenizer`: a Hugging Face `tokenizer.json`), else the documented estimate of
`limits.tokens_per_char` tokens per request byte. The tokenizer costs about 60 µs for a 200-character
prompt on this machine, so it is opt-in.

A long text is counted with `encode_batch`, which lets go of the GIL while Rust works (`encode` keeps it: a
4 MB prompt counted in a thread held the gateway's event loop for its whole 3.8 s; through `encode_batch`,
69 ms at most, measured); for a short one `encode` is the cheaper call. The gateway counts long prompts in
threads of their own (gateway/intake.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LONG_TEXT_CHARS", "TokenCounter", "TokenSizing"]

LONG_TEXT_CHARS = 4096  # a text this long is counted without the GIL, off the event loop (a few ms and more)


class TokenCounter:
    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer  # the Rust tokenizers library, only when a model names a tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def count(self, text: str) -> int:
        if len(text) >= LONG_TEXT_CHARS:
            return len(self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass
class TokenSizing:
    """How the gateway sizes a request before it runs: by the model's own tokenizer where the spec names
    one, else by its bytes. Models added (a live apply) bring their counters; `tokens_per_byte` follows the
    spec's `limits.tokens_per_char`."""

    tokens_per_byte: float
    counters: dict[str, TokenCounter] = field(default_factory=dict)
