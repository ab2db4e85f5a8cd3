"""Calls Redis may have missed: a reservation or settlement whose reply came late or never (after the
client's timeout Redis may still have run it), kept to be sent again until Redis answers. The budget's
holds (budget.py) and the rate limiter's leases (limits_redis.py) keep theirs so."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["Owed"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Owed(Generic[K, V]):
    """Per key, by entry, oldest first; at most `most` in all: past that, the oldest key's oldest entry is
    dropped (its lease or hold ends in Redis by itself). A key's entries are looked up afresh at each
    change, so a sending that overlaps another's never takes away entries owed meanwhile."""

    def __init__(self, most: int) -> None:
        self._by_key: dict[K, dict[str, V]] = {}
        self._most = most
        self.count = 0  # entries kept, all keys'

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def keys(self) -> list[K]:
        return list(self._by_key)

    def of(self, key: K) -> Iterator[tuple[str, V]]:
        """`key`'s entries, oldest first (a copy: they may change while it is read)."""
        return iter(list(self._by_key.get(key, {}).items()))

    def add(self, key: K, entry: str, value: V, keep_first: bool = False) -> None:
        """Owe `entry` of `key` (its value replaced where it is owed already, unless `keep_first`)."""
        owed = self._by_key.setdefault(key, {})
        if entry not in owed:
            self.count += 1
        elif keep_first:
            return
        owed[entry] = value
        if self.count > self._most:
            first = next(iter(self._by_key))
            self.discard(first, next(iter(self._by_key[first])))

    def discard(self, key: K, entry: str) -> None:
        """`entry` of `key` is owed no more (sent, or past changing anything)."""
        owed = self._by_key.get(key)
        if owed is None or owed.pop(entry, None) is None:
            return
        self.count -= 1
        if not owed:
            del self._by_key[key]
