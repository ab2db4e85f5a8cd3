"""Admission: who is asking (keys), whether they may now (limits, budgets), and when (the fair queue)."""

from corral.admission.auth import ANONYMOUS, Authenticator, Principal
from corral.admission.budget import BudgetTracker
from corral.admission.limits import Limiter, LimiterUnavailable, MemoryLimiter, RedisLimiter, Reservation
from corral.admission.queue import FairQueue
from corral.admission.tokens import TokenCounter

__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "BudgetTracker",
    "FairQueue",
    "Limiter",
    "LimiterUnavailable",
    "MemoryLimiter",
    "Principal",
    "RedisLimiter",
    "Reservation",
    "TokenCounter",
]
