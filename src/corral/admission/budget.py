"""Monthly token budgets per key: usage so far (from the store, refreshed) plus what is in flight here."""

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
        # key id → (tenant, monthly budget, month "YYYY-MM", last checked (monotonic s))
        self._budgets: dict[str, tuple[str, int, str, float]] = {}

    async def check(self, principal: Principal, tokens: int) -> None:
        budget, key = principal.monthly_token_budget, principal.key_id
        if budget is None or key is None:
            return
        self._budgets[key] = (principal.tenant, budget, _month(), time.monotonic())
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
