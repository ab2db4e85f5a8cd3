"""Monthly token budgets per key: usage so far (from the store, refreshed), plus what settled here since,
plus what requests in flight here have reserved (their estimate: prompt and max_tokens), so concurrent
requests cannot all pass a check that only one of them fits."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from corral.admission.auth import Principal
from corral.protocol import RateLimited
from corral.store import UsageStore

__all__ = ["BudgetTracker"]

_QUIET_S = 86400.0  # a budgeted key not seen for a day leaves the budget metric


def _month() -> str:
    return datetime.now(UTC).strftime("%Y-%m")


class BudgetTracker:
    def __init__(self, usage: UsageStore, refresh_s: float = 30.0) -> None:
        self._usage = usage
        self._refresh = refresh_s
        self._used: dict[str, tuple[int, float]] = {}  # key id → (tokens this month, read at)
        self._local: dict[str, int] = {}  # settled here since the last read
        self._reserved: dict[str, int] = {}  # key id → tokens requests in flight here have reserved
        # key id → (tenant, monthly budget, month "YYYY-MM", last checked (monotonic s))
        self._budgets: dict[str, tuple[str, int, str, float]] = {}

    async def reserve(self, principal: Principal, tokens: int) -> int:
        """Reserve `tokens` of the key's monthly budget for a request; what was reserved (0 for a key
        without a budget), handed back to `settle`. Raises RateLimited when they do not fit."""
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return 0
        self._budgets[key] = (principal.tenant, budget, _month(), time.monotonic())
        used = await self._month_tokens(key) + self._reserved.get(key, 0)  # (no await after this read)
        if used + tokens > budget:
            now = datetime.now(UTC)
            next_month = (now.replace(day=28) + (now.replace(day=28) - now.replace(day=1))).replace(
                day=1, hour=0, minute=0, second=0, microsecond=0
            )
            raise RateLimited(
                f"This key has used or reserved {used:,} of its {budget:,} tokens this month; this "
                f"request needs up to {tokens:,}.",
                code="insufficient_quota",
                retry_after=(next_month - now).total_seconds(),
            )
        self._reserved[key] = self._reserved.get(key, 0) + tokens
        return tokens

    def spent(self) -> list[tuple[str, str, float]]:
        """(tenant, key id, share of the monthly budget used) for each budgeted key that asked this
        gateway this month within the last day; keys of a past month or gone quiet (revoked) drop out."""
        month, now = _month(), time.monotonic()
        for key in [k for k, (_, _, m, seen) in self._budgets.items() if m != month or now - seen > _QUIET_S]:
            del self._budgets[key]
        out = []
        for key, (tenant, budget, _, _) in self._budgets.items():
            cached = self._used.get(key)
            used = (cached[0] if cached else 0) + self._local.get(key, 0)
            out.append((tenant, key, used / budget))
        return out

    def settle(self, principal: Principal, tokens: int, reserved: int = 0) -> None:
        """A request ended having used `tokens`: its reservation (`reserved`) is released."""
        key = principal.key_id
        if principal.monthly_token_budget is None or key is None:
            return
        self._local[key] = self._local.get(key, 0) + tokens
        if reserved:
            left = self._reserved.get(key, 0) - reserved
            if left > 0:
                self._reserved[key] = left
            else:
                self._reserved.pop(key, None)

    async def _month_tokens(self, key: str) -> int:
        cached = self._used.get(key)
        now = time.monotonic()
        if cached is None or now - cached[1] > self._refresh:
            stored = await asyncio.to_thread(self._usage.month_tokens, key)
            self._used[key] = (stored, now)
            self._local[key] = 0
            cached = self._used[key]
        return cached[0] + self._local.get(key, 0)
