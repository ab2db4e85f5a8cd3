"""What routing knows about a request: its model, size, session, and (lazily) its prompt's prefix blocks."""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from operator import mul

import numpy as np

from corral.routing.adapters import Adapter, Residence
from corral.routing.prefix import Prefill

__all__ = ["PREFIX_BLOCK_CHARS", "PrefixHasher", "RouteRequest", "prefix_hashes"]

PREFIX_BLOCK_CHARS = 128  # about 32 tokens: coarse enough to hash cheaply, fine enough to tell prompts apart
_MAX_BLOCKS = 256  # look at the first ~32 KB
_WORDS = PREFIX_BLOCK_CHARS // 8
_MASK = 2**64 - 1
# Fixed odd multipliers (any would do; fixed, so every gateway process hashes alike): one per 8-byte word
# of a block, one per block position.
_MIX = np.random.default_rng(0x5EED).integers(1, 2**63, size=(_WORDS + _MAX_BLOCKS,), dtype=np.uint64) | 1
_WORD_MIX, _POSITION_MIX = _MIX[:_WORDS], _MIX[_WORDS:]
_SHIFT_A, _SHIFT_B, _MIX_C = np.uint64(31), np.uint64(29), np.uint64(0xBF58476D1CE4E5B9)
_WORD_MIX_INTS: tuple[int, ...] = tuple(_WORD_MIX.tolist())  # the same, as Python ints (a short tail)
_POSITION_MIX_INTS: tuple[int, ...] = tuple(_POSITION_MIX.tolist())
_MIX_C_INT = int(_MIX_C)
_BLOCK_WORDS = struct.Struct(f"<{_WORDS}Q")
_FEW_BLOCKS = 6  # at most this many blocks are hashed in Python: fewer calls than numpy's, on a cold cache


def prefix_hashes(text: str) -> tuple[int, ...]:
    """Hashes of the prompt's leading prefixes, one per whole 128-byte block (UTF-8): equal hashes mean
    equal prefixes. Each block is hashed from its eight-byte words and the prefix's hash is the sum of its
    blocks' hashes, each times its position's multiplier (mod 2**64): numpy does it for all blocks at once:
    15 µs on a 26 KB prompt (the routing benchmark's) where block by block in Python took 55; a few
    blocks go faster in Python (`_FEW_BLOCKS`). A gateway hashes with a `PrefixHasher`."""
    data = text.encode()
    return _chain(data, 0, min(len(data) // PREFIX_BLOCK_CHARS, _MAX_BLOCKS), 0)


def _chain(data: bytes, start: int, count: int, base: int) -> tuple[int, ...]:
    """The prefix hashes of blocks `start` to `count` of `data`, continuing `base` (the hash of the
    prefix before block `start`; 0 at the start)."""
    if count - start <= _FEW_BLOCKS:
        return _chain_few(data, start, count, base)
    words = np.frombuffer(
        data, dtype="<u8", count=(count - start) * _WORDS, offset=start * PREFIX_BLOCK_CHARS
    )
    blocks = words.reshape(count - start, _WORDS) @ _WORD_MIX  # integer matmul wraps mod 2**64 (2× faster)
    blocks ^= blocks >> _SHIFT_A  # mix the high bits down: the multiplications only carry upwards
    blocks *= _MIX_C
    blocks ^= blocks >> _SHIFT_B
    blocks *= _POSITION_MIX[start:count]
    blocks[:1] += np.uint64(base)  # (an array: wraps mod 2**64 without a warning, as a scalar would not)
    chain: list[int] = blocks.cumsum(dtype=np.uint64).tolist()
    return tuple(chain)


def _chain_few(data: bytes, start: int, count: int, base: int) -> tuple[int, ...]:
    """`_chain` block by block in Python ints, the same arithmetic mod 2**64."""
    mix, positions, unpack, mask = _WORD_MIX_INTS, _POSITION_MIX_INTS, _BLOCK_WORDS.unpack_from, _MASK
    chain = []
    for position in range(start, count):
        block = sum(map(mul, unpack(data, position * PREFIX_BLOCK_CHARS), mix)) & mask
        block ^= block >> 31
        block = block * _MIX_C_INT & mask
        block ^= block >> 29
        base = (base + block * positions[position]) & mask
        chain.append(base)
    return tuple(chain)


class PrefixHasher:
    """`prefix_hashes` that remembers the latest prompts, by their first block, with their hashes.

    Most prompts repeat a recent one's start (a tenant's system prompt or document, a conversation's
    history): the blocks they share are found by comparing bytes (a few `memcmp`s) and their hashes reused,
    and only the rest is hashed. In a gateway between requests, numpy's many small calls ran on a cold CPU
    cache: 110–130 µs for a 26 KB prompt there, against about 50 µs this way. Holds at most `remember`
    prompts' first 64 KB (16 MB by default), in the gateway's memory only.
    """

    def __init__(self, remember: int = 256) -> None:
        # first block → (the latest such prompt, its hashes, the blocks it shared with the one before)
        self._recent: OrderedDict[bytes, tuple[bytes, tuple[int, ...], int]] = OrderedDict()
        self._remember = remember

    def hashes(self, text: str) -> tuple[int, ...]:
        data = text.encode()
        count = min(len(data) // PREFIX_BLOCK_CHARS, _MAX_BLOCKS)
        if not count:
            return ()
        key = data[:PREFIX_BLOCK_CHARS]
        known = self._recent.get(key)
        if known is None:
            same, chain = 0, _chain(data, 0, count, 0)
        else:
            old, old_chain, guess = known
            same = _common_blocks(data, old, min(count, len(old_chain)), guess)
            chain = old_chain[:same] + _chain(data, same, count, old_chain[same - 1])
            self._recent.move_to_end(key)
        kept = (
            data if len(data) <= 2 * _MAX_BLOCKS * PREFIX_BLOCK_CHARS else data[: count * PREFIX_BLOCK_CHARS]
        )
        self._recent[key] = (kept, chain, same)
        if len(self._recent) > self._remember:
            self._recent.popitem(last=False)
        return chain


def _common_blocks(data: bytes, old: bytes, most: int, guess: int) -> int:
    """How many leading whole blocks `data` shares with `old` (at least its first, which found `old`; at
    most `most`), each test a comparison of bytes with no copy: first `most`, then `guess` (what `old`
    shared with the prompt before it: a tenant's document, say), else by bisection."""
    view = memoryview(old)
    if data.startswith(view[: most * PREFIX_BLOCK_CHARS]):
        return most
    if 0 < guess < most and data.startswith(view[: guess * PREFIX_BLOCK_CHARS]):
        if not data.startswith(view[: (guess + 1) * PREFIX_BLOCK_CHARS]):
            return guess
        low, high = guess + 1, most - 1
    else:
        low, high = 1, (guess if 0 < guess < most else most) - 1
    # the first `low` blocks are shared; block `high + 1` is not
    while low < high:
        middle = (low + high + 1) // 2
        if data.startswith(view[: middle * PREFIX_BLOCK_CHARS]):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(slots=True)
class RouteRequest:
    """A request as routing policies see it."""

    model: str
    tokens: int = 0  # estimated input + requested output tokens
    tenant: str = ""  # who sent it (set on a multi-tenant gateway: breakers tell tenants apart)
    session: str | None = None
    prompt: str = ""
    prompt_tokens: int = 0  # estimated input tokens
    sequences: int = 1  # the sequences it runs at once on its replica (n × prompts; embedding inputs)
    held: int = 1  # of its replica's slots, counted in `outstanding` (its sequences, at most all; the router)
    prefill: int = 0  # tokens the chosen replica is expected to prefill (not in its cache), set by the router
    inflight: Prefill | None = field(default=None, repr=False)  # its prefill, while it runs (router.py)
    # its blocks' mark in the prefix index while it runs (negative, its own), set by the policy (prefix.py)
    use: float = 0.0
    adapter: Adapter | None = None  # the LoRA adapter that answers it (`model` is then its base)
    load_adapter: bool = False  # the chosen replica must load the adapter first (set by the router)
    residence: Residence | None = None  # the adapter on the chosen replica, counted in flight (router)
    trial: bool = False  # it is its replica's half-open breaker's one trial (router)
    _hashes: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def hashes(self) -> tuple[int, ...]:
        if self._hashes is None:
            self._hashes = prefix_hashes(self.prompt)
        return self._hashes

    def hash_prompt(self, hasher: PrefixHasher) -> tuple[int, ...]:
        """The prompt's prefix hashes, by `hasher` (which reuses a recent prompt's) unless already known."""
        if self._hashes is None:
            self._hashes = hasher.hashes(self.prompt)
        return self._hashes
