"""Monthly token budgets per key: usage so far (from the store, refreshed) plus what is in flight here."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from corral.admission.auth import Principal
from corral.protocol import RateLimited
from corral.store import UsageStore

__all__ = ["BudgetTracker"]


class BudgetTracker:
    def __init__(self, usage: UsageStore, refresh_s: float = 30.0) -> None:
        self._usage = usage
        self._refresh = refresh_s
        self._used: dict[str, tuple[int, float]] = {}  # key id → (tokens this month, read at)
        self._local: dict[str, int] = {}  # settled here since the last read
        self._budgets: dict[str, tuple[str, int]] = {}  # key id → (tenant, monthly budget)

    async def check(self, principal: Principal, tokens: int) -> None:
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return
        self._budgets[key] = (principal.tenant, budget)
        used = await self._month_tokens(key)
        if used + tokens > budget:
            now = datetime.now(UTC)
            next_month = (now.replace(day=28) + (now.replace(day=28) - now.replace(day=1))).replace(
                day=1, hour=0, minute=0, second=0, microsecond=0
            )
            raise RateLimited(
                f"This key has used {used:,} of its {budget:,} tokens this month.",
                code="insufficient_quota",
                retry_after=(next_month - now).total_seconds(),
            )

    def spent(self) -> list[tuple[str, str, float]]:
        """(tenant, key id, share of the monthly budget used) for each budgeted key seen here."""
        out = []
        for key, (tenant, budget) in self._budgets.items():
            cached = self._used.get(key)
            used = (cached[0] if cached else 0) + self._local.get(key, 0)
            out.append((tenant, key, used / budget))
        return out

    def add(self, principal: Principal, tokens: int) -> None:
        if principal.monthly_token_budget is not None and principal.key_id is not None:
            self._local[principal.key_id] = self._local.get(principal.key_id, 0) + tokens

    async def _month_tokens(self, key: str) -> int:
        cached = self._used.get(key)
        now = time.monotonic()
        if cached is None or now - cached[1] > self._refresh:
            stored = await asyncio.to_thread(self._usage.month_tokens, key)
            self._used[key] = (stored, now)
            self._local[key] = 0
            cached = self._used[key]
        return cached[0] + self._local.get(key, 0)
