"""An approximate index of which replica has served which prompt prefixes (so likely has them cached).

Bounded per replica, least recently used first out, as an engine's prefix cache evicts: by the replica's
own KV cache where its engine reports the size (vLLM's and the simulator's `cache_config_info`), else by
`max_blocks`; where the engine's KV events are followed, also by what it evicted (`evict_through`: every
block whose last request ended before a block the engine evicted was cached) and emptied (`forget`). It is
a guess, not the engines' truth: a wrong guess costs a cache miss.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from corral.routing.replicas import Replica

__all__ = ["Prefill", "PrefillTracker", "PrefixIndex"]

_IN_USE = -math.inf  # a block's mark while a request that uses it runs (unless the request has its own)
_ENDS_KEPT = 4096  # requests' ends kept per replica until its engine's evictions pass them


class PrefixIndex:
    """Per replica, the prompt blocks (by hash) it likely holds, least recently used first.

    An engine's cache holds what its own requests left there and evicts the least recently used blocks when
    it needs room: a replica's blocks here are bounded by the blocks of its cache (`record`'s `capacity`),
    so that a document the replica must have evicted stops counting as cached there. Only the latest
    replicas recorded are kept: `max_replicas`, or twice the replicas `keep` was last told of where that is
    more, so a fleet of any size keeps every live replica's blocks while ids that left unannounced stay
    bounded (replica ids are never reused: rollouts and restarts make new ones). Blocks are plain ints in
    one ordered dict per replica: nothing for the garbage collector to walk (a set per block made a full
    index 200,000 more objects, about 90 ms more pause on this project's test machine, during which the
    gateway relays nothing).
    """

    def __init__(self, max_blocks: int = 25_000, max_replicas: int = 64) -> None:
        # per replica, block → when the last request that used it ended, or while one runs that request's
        # `use` mark (negative: `_IN_USE` when none is given), in order of each block's latest routing
        self._held: dict[str, OrderedDict[int, float]] = {}
        # blocks per replica whose cache size is not known: about 800,000 tokens at 4 bytes a token, more
        # than most engines' caches; at about 140 bytes a block, 3.5 MB per replica
        self._max = max_blocks
        self._least_replicas = max_replicas
        self._max_replicas = max_replicas  # at least twice the live replicas (`keep`)
        # per replica, requests' ends in the order they ended: (when, its prompt's blocks)
        self._ends: dict[str, deque[tuple[float, Sequence[int]]]] = {}
        # not yet applied: records (True, hashes, replica, capacity, use: see `record`) and requests' ends
        # (False, hashes, replica, when, its record's use)
        self._pending: list[tuple[bool, Sequence[int], str, float | None, float]] = []

    def __len__(self) -> int:
        """Blocks held, over all replicas."""
        self._apply()
        return sum(len(held) for held in self._held.values())

    def keep(self, replica_ids: set[str]) -> None:
        """Forget the replicas not among these (they left the cluster); keep room for twice as many."""
        self._apply()
        self._max_replicas = max(self._least_replicas, 2 * len(replica_ids))
        for rid in [rid for rid in self._held if rid not in replica_ids]:
            del self._held[rid]
            self._ends.pop(rid, None)

    def evict_through(self, rid: str, when: float) -> None:
        """Forget replica `rid`'s blocks whose last request ended before `when`: its engine has evicted
        a block it cached at `when`, and an engine's cache evicts the blocks its requests freed least
        recently first (a block is freed no earlier than it was cached). A block a later request used (or
        uses now) stays."""
        self._apply()
        held, ends = self._held.get(rid), self._ends.get(rid)
        if held is None or not ends:
            return
        while ends and ends[0][0] < when:
            ended, hashes = ends.popleft()
            for block in hashes:
                if held.get(block) == ended:
                    del held[block]

    def forget(self, rid: str) -> None:
        """Forget all of replica `rid`'s blocks (its engine's cache was emptied)."""
        self._apply()
        self._held.pop(rid, None)
        self._ends.pop(rid, None)

    def ended(self, hashes: Sequence[int], replica: Replica, when: float, use: float) -> None:
        """A request that used these blocks on `replica` (recorded with `use`) ended at `when` (wall
        clock): their engine freed them then (see `evict_through`), unless a request recorded later uses
        them still. Applied with the records, on the event loop's next turn."""
        if hashes:
            self._pending.append((False, hashes, replica.id, when, use))
            if len(self._pending) == 1:
                self._apply_soon()

    def held(self) -> dict[str, int]:
        """Blocks held, per replica."""
        self._apply()
        return {rid: len(held) for rid, held in self._held.items()}

    def depths(self, hashes: Sequence[int], candidates: Sequence[Replica]) -> dict[str, int]:
        """For each candidate, how many leading blocks of the prompt it has served before (and not evicted).

        What a replica holds of a prompt's chain of blocks is always a prefix of it (see `record`), so its
        depth is found by bisection: a few look-ups per replica, not one per block.
        """
        self._apply()
        depth = {}
        for replica in candidates:
            held = self._held.get(replica.id)
            low, high = 0, len(hashes) if held else 0  # it holds the first `low` blocks, not block `high`
            while low < high:
                middle = (low + high + 1) // 2
                if hashes[middle - 1] in held:  # type: ignore[operator]
                    low = middle
                else:
                    high = middle - 1
            depth[replica.id] = low
        return depth

    def record(
        self, hashes: Sequence[int], replica: Replica, capacity: int | None = None, use: float = _IN_USE
    ) -> None:
        """Note that `replica` served these blocks, in a cache of `capacity` blocks (None: `max_blocks`),
        where they are now the most recently used. Blocks are touched last first, so a chain's first blocks
        are always the more recently used: eviction takes chains from their ends (as an engine's cache frees
        a finished request's blocks, last first), and what a replica holds of a chain stays a prefix of it (a
        block evicted before the ones that lead to it is impossible).

        Only a prompt's first 256 blocks (32 KB) are hashed, so a longer prompt takes more of the engine's
        cache than it takes here.

        In a gateway the record is applied on the event loop's next turn, after the request it routed has
        gone out (or by the next look-up, whichever comes first): touching a long prompt's 200 blocks took
        about 60 µs of that request's way to its engine."""
        self._pending.append((True, hashes, replica.id, capacity, use))
        if len(self._pending) == 1:
            self._apply_soon()

    def _apply_soon(self) -> None:
        try:
            asyncio.get_running_loop().call_soon(self._apply)
        except RuntimeError:  # no event loop (the routing replay, a test): at once
            self._apply()

    def _apply(self) -> None:
        pending, self._pending = self._pending, []
        for recorded, hashes, rid, number, use in pending:
            if recorded:  # `number`: the replica's capacity
                self._record(hashes, rid, self._max if number is None else number, use)
            else:  # a request's end, at `number`
                self._ended(hashes, rid, number or 0.0, use)

    def _ended(self, hashes: Sequence[int], rid: str, when: float, use: float) -> None:
        held = self._held.get(rid)
        if held is None:
            return
        for block in hashes:  # (their order stays the order of routing: measured better for it)
            if held.get(block) == use:  # not recorded since by a request that may still use it
                held[block] = when
        ends = self._ends.get(rid)
        if ends is None:
            ends = self._ends[rid] = deque(maxlen=_ENDS_KEPT)
        ends.append((when, hashes))

    def _record(self, hashes: Sequence[int], rid: str, capacity: float, use: float) -> None:
        replicas = self._held
        held = replicas.pop(rid, None)
        if held is None:
            held = OrderedDict()
            if len(replicas) >= self._max_replicas:  # rare: a replica that left before `keep` was told
                del replicas[next(iter(replicas))]
        replicas[rid] = held  # now the most recently recorded
        touch = held.move_to_end  # bound once: 200 blocks a prompt
        for block in reversed(hashes):
            held[block] = use  # (a new key goes last; an old one keeps its place until touched)
            touch(block)
        while len(held) > capacity:
            held.popitem(last=False)


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
