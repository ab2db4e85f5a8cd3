"""An approximate index of which replica has served which prompt prefixes (so likely has them cached).

Bounded: at most `max_blocks` block hashes are remembered, least recently used first out, mirroring how an
engine's prefix cache evicts. It is a guess, not the engines' truth: a wrong guess costs a cache miss.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from corral.routing.replicas import Replica

__all__ = ["Prefill", "PrefillTracker", "PrefixIndex"]


class PrefixIndex:
    """Block hash → the replicas that served it, as a bit mask (one bit per replica).

    Masks are plain ints, which the garbage collector does not track: a set per block made a full index
    (200,000 blocks) 200,000 more objects for every full collection to walk, about 90 ms more pause on
    this project's test machine, during which the gateway relays nothing. A replica's bit is recycled, and
    cleared from every mask, when `max_replicas` others have been recorded since it last was (replica ids
    are never reused: rollouts and restarts make new ones).
    """

    def __init__(self, max_blocks: int = 200_000, max_replicas: int = 64) -> None:
        self._owners: OrderedDict[int, int] = OrderedDict()
        self._max = max_blocks
        self._bits: dict[str, int] = {}  # replica id → its bit; in order of its latest record
        self._max_replicas = max_replicas
        self._pending: list[tuple[Sequence[int], str]] = []  # records not yet applied (see `record`)

    def __len__(self) -> int:
        self._apply()
        return len(self._owners)

    def depths(self, hashes: Sequence[int], candidates: Sequence[Replica]) -> dict[str, int]:
        """For each candidate, how many leading blocks of the prompt it has served before.

        What a replica holds of a prompt's chain of blocks is always a prefix of it (see `record`), so its
        depth is found by bisection: a few look-ups per replica, not one per block.
        """
        self._apply()
        owners_of = self._owners.get
        depth = {}
        for replica in candidates:
            bit = self._bits.get(replica.id, 0)
            low, high = 0, len(hashes) if bit else 0  # it holds the first `low` blocks, not block `high`
            while low < high:
                middle = (low + high + 1) // 2
                if owners_of(hashes[middle - 1], 0) & bit:
                    low = middle
                else:
                    high = middle - 1
            depth[replica.id] = low
        return depth

    def record(self, hashes: Sequence[int], replica: Replica) -> None:
        """Note that `replica` served these blocks. They are touched last block first, so a chain's first
        blocks are always the more recently used: eviction takes chains from their ends (as an engine's
        cache frees a finished request's blocks, last first), and what a replica holds of a chain stays a
        prefix of it (a block evicted before the ones that lead to it is impossible).

        In a gateway the record is applied on the event loop's next turn, after the request it routed has
        gone out (or by the next look-up, whichever comes first): touching a long prompt's 200 blocks took
        about 60 µs of that request's way to its engine."""
        self._pending.append((hashes, replica.id))
        if len(self._pending) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._apply)
            except RuntimeError:  # no event loop (the routing replay, a test): at once
                self._apply()

    def _apply(self) -> None:
        pending, self._pending = self._pending, []
        for hashes, rid in pending:
            self._record(hashes, rid)

    def _record(self, hashes: Sequence[int], rid: str) -> None:
        bit = self._bit(rid)
        owners_of = self._owners
        owners_of_get, touch = owners_of.get, owners_of.move_to_end  # bound once: 200 blocks a prompt
        for block in reversed(hashes):
            owners = owners_of_get(block)
            if owners is None:
                owners_of[block] = bit
            else:
                if not owners & bit:
                    owners_of[block] = owners | bit
                touch(block)
        while len(owners_of) > self._max:
            owners_of.popitem(last=False)

    def _bit(self, rid: str) -> int:
        """`rid`'s bit, now the most recently recorded; a new replica takes a free bit, or the bit of the
        replica recorded least recently (cleared from every mask first) when all are taken."""
        bits = self._bits
        bit = bits.pop(rid, 0)
        if not bit:
            if len(bits) < self._max_replicas:
                taken = 0
                for used in bits.values():
                    taken |= used
                bit = ~taken & (taken + 1)  # the lowest free bit
            else:
                bit = bits.pop(next(iter(bits)))  # rare: `max_replicas` new ids since that one's last
                owners_of = self._owners
                for block in [block for block, owners in owners_of.items() if owners & bit]:
                    if rest := owners_of[block] & ~bit:
                        owners_of[block] = rest
                    else:
                        del owners_of[block]
        bits[rid] = bit
        return bit


class Prefill:
    """One request's prefill of some prompt blocks on one replica, until its first token (or its end)."""

    __slots__ = ("blocks", "done", "replica")

    def __init__(self, replica: str, blocks: Sequence[int]) -> None:
        self.replica = replica
        self.blocks = blocks
        self.done = asyncio.Event()


class PrefillTracker:
    """The prefills running now, by the prompt blocks they compute.

    A request whose long prefix another request is computing right now on the same replica can wait for
    that prefill to finish and then find the prefix in the engine's cache, instead of computing it a second
    time alongside (engines only reuse blocks that are complete when a request is scheduled). Duplicate cold
    prefills of one prefix are the main waste when a tenant's requests come in bursts.
    """

    def __init__(self) -> None:
        self._by_block: dict[int, Prefill] = {}

    def start(self, replica: str, blocks: Sequence[int]) -> Prefill:
        prefill = Prefill(replica, blocks)
        for block in blocks:
            self._by_block.setdefault(block, prefill)
        return prefill

    def finish(self, prefill: Prefill) -> None:
        if prefill.done.is_set():
            return
        prefill.done.set()
        for block in prefill.blocks:
            if self._by_block.get(block) is prefill:
                del self._by_block[block]

    def covering(
        self, hashes: Sequence[int], replica: str, mine: Prefill | None
    ) -> tuple[Prefill | None, int]:
        """The running prefill (not `mine`) on `replica` that computes the deepest block of `hashes`, and
        how many leading blocks of `hashes` it reaches; (None, 0) when none does."""
        if not self._by_block:
            return None, 0
        for depth in range(len(hashes), 0, -1):
            prefill = self._by_block.get(hashes[depth - 1])
            if prefill is not None and prefill is not mine and prefill.replica == replica:
                return prefill, depth
        return None, 0
