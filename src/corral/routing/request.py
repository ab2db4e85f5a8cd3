"""What routing knows about a request: its model, size, session, and (lazily) its prompt's prefix blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from corral.routing.prefix import Prefill

__all__ = ["PREFIX_BLOCK_CHARS", "RouteRequest", "prefix_hashes"]

PREFIX_BLOCK_CHARS = 128  # about 32 tokens: coarse enough to hash cheaply, fine enough to tell prompts apart
_MAX_BLOCKS = 256  # look at the first ~32k characters


def prefix_hashes(text: str) -> tuple[int, ...]:
    """Chained hashes of the prompt's leading fixed-size blocks: equal hashes mean equal prefixes."""
    hashes = []
    parent = 0
    end = min(len(text), PREFIX_BLOCK_CHARS * _MAX_BLOCKS)
    for start in range(0, end - PREFIX_BLOCK_CHARS + 1, PREFIX_BLOCK_CHARS):
        parent = hash((parent, text[start : start + PREFIX_BLOCK_CHARS]))
        hashes.append(parent)
    return tuple(hashes)


@dataclass(slots=True)
class RouteRequest:
    """A request as routing policies see it."""

    model: str
    tokens: int = 0  # estimated input + requested output tokens
    session: str | None = None
    prompt: str = ""
    prompt_tokens: int = 0  # estimated input tokens
    prefill: int = 0  # tokens the chosen replica is expected to prefill (not in its cache), set by the router
    inflight: Prefill | None = field(default=None, repr=False)  # its prefill, while it runs (router.py)
    _hashes: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def hashes(self) -> tuple[int, ...]:
        if self._hashes is None:
            self._hashes = prefix_hashes(self.prompt)
        return self._hashes
