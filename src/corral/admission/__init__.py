"""Admission: who is asking (keys), whether they may now (limits, budgets), and when (the fair queue)."""

from corral.admission.auth import ANONYMOUS, Authenticator, Principal
from corral.admission.budget import BudgetTracker
from corral.admission.limits import (
    Limiter,
    LimiterUnavailable,
    MemoryLimiter,
    RateLimits,
    RedisLimiter,
    Reservation,
)
from corral.admission.queue import Capacity, FairQueue
from corral.admission.tokens import TokenCounter, TokenSizing

__all__ = [
    "ANONYMOUS",
    "Authenticator",
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
    "TokenCounter",
    "TokenSizing",
]
