"""Batches in flight: one at a time, or `pp` at once under pipeline parallelism (each entering when the
first stage is free). Shared by the planner's virtual clock and the simulator's real one."""

from __future__ import annotations

import heapq

from corral.perf.scheduler import Batch
from corral.perf.timing import PerfModel

__all__ = ["StepPipeline"]


class StepPipeline:
    """Launches batches with their step times and hands them back in completion order."""

    def __init__(self, perf: PerfModel) -> None:
        self._perf = perf
        self._in_flight: list[tuple[float, int, Batch]] = []
        self._entry_free_at = 0.0
        self._launched = 0

    @property
    def has_room(self) -> bool:
        return len(self._in_flight) < self._perf.pp

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    @property
    def next_finish(self) -> float:
        return self._in_flight[0][0]

    def launch(self, batch: Batch, now: float) -> float:
        """Start `batch` at `now` (or when the first stage frees up); its completion time."""
        duration = self._perf.step_time(
            batch.decode_tokens, batch.decode_context, batch.prefill_tokens, batch.prefill_pairs
        )
        start = max(now, self._entry_free_at)
        self._entry_free_at = start + duration / self._perf.pp
        finish = start + duration
        heapq.heappush(self._in_flight, (finish, self._launched, batch))
        self._launched += 1
        return finish

    def pop(self) -> tuple[float, Batch]:
        finish, _, batch = heapq.heappop(self._in_flight)
        return finish, batch
