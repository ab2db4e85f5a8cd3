"""An approximate index of which replica has served which prompt prefixes (so likely has them cached).

Bounded: at most `max_blocks` block hashes are remembered, least recently used first out, mirroring how an
engine's prefix cache evicts. It is a guess, not the engines' truth: a wrong guess costs a cache miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from corral.routing.replicas import Replica

__all__ = ["PrefixIndex"]


class PrefixIndex:
    def __init__(self, max_blocks: int = 200_000) -> None:
        self._owners: OrderedDict[int, set[str]] = OrderedDict()
        self._max = max_blocks

    def __len__(self) -> int:
        return len(self._owners)

    def depths(self, hashes: Sequence[int], candidates: Sequence[Replica]) -> dict[str, int]:
        """For each candidate, how many leading blocks of the prompt it has served before."""
        alive = {r.id for r in candidates}
        depth = dict.fromkeys(alive, 0)
        for i, block in enumerate(hashes):
            owners = self._owners.get(block)
            if not owners:
                break
            alive &= owners
            if not alive:
                break
            for rid in alive:
                depth[rid] = i + 1
        return depth

    def record(self, hashes: Sequence[int], replica: Replica) -> None:
        for block in hashes:
            owners = self._owners.get(block)
            if owners is None:
                self._owners[block] = {replica.id}
            else:
                owners.add(replica.id)
                self._owners.move_to_end(block)
        while len(self._owners) > self._max:
            self._owners.popitem(last=False)
