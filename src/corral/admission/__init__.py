"""Admission: who is asking (keys), whether they may now (limits, budgets), and when (the fair queue)."""

from corral.admission.auth import ANONYMOUS, Authenticator, Principal
from corral.admission.budget import BudgetHold, BudgetTracker, SharedBudgets
from corral.admission.limits import Limiter, LimiterUnavailable, MemoryLimiter, RateLimits, Reservation
from corral.admission.limits_redis import RedisLimiter
from corral.admission.queue import Capacity, FairQueue
from corral.admission.tokens import TokenCounter, TokenSizing

__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "BudgetHold",
    "BudgetTracker",
    "Capacity",
    "FairQueue",
    "Limiter",
    "LimiterUnavailable",
    "MemoryLimiter",
    "Principal",
    "RateLimits",
    "RedisLimiter",
    "Reservation",
    "SharedBudgets",
    "TokenCounter",
    "TokenSizing",
]
