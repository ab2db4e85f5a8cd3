"""Batches in flight: one at a time, or `pp` at once under pipeline parallelism (each entering when the
first stage is free). Shared by the planner's virtual clock and the simulator's real one.

Under pipeline parallelism the virtual clocks spend most steps in stretches where the running sequences
are split into the same decode-only batches round after round (each batch relaunched as it comes out of
the last stage); `decode_rounds` takes such a stretch without building and scheduling each batch, leaving
the pipeline and the scheduler exactly as stepping through it would (tests/perf/test_workload.py).
"""

from __future__ import annotations

import heapq
import math

from corral.perf.scheduler import Batch, EngineSequence, Scheduler
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

    def decode_rounds(
        self, scheduler: Scheduler, now: float, until: float = math.inf
    ) -> tuple[float, list[tuple[list[EngineSequence], int]]] | None:
        """Under pipeline parallelism, where every running sequence decodes and nobody waits: launch the
        sequences not in flight as a batch, then, batch by batch as each comes out before `until`, apply
        it and launch it again, as `schedule`, `launch`, `pop` and `complete` would, up to the first
        batch that would finish a sequence, need a block that is not free, or come out at or after
        `until` (an arrival joins the batch launched after it). The time of the last batch out (`now`
        where none came out) and each batch's sequences with the tokens each made; None where the
        stretch does not start here (the caller steps)."""
        config = scheduler.config
        if self._perf.pp == 1 or scheduler.waiting or not scheduler.running:
            return None
        free: list[EngineSequence] = []
        for seq in scheduler.running:
            if seq.computed < seq.prompt_len or seq.pending != 1 or seq.registered < len(seq.hashes):
                return None
            if not seq.in_flight:
                free.append(seq)
        if free and (not self.has_room or len(free) > config.max_num_batched_tokens):
            return None
        for _, _, batch in self._in_flight:
            if batch.prefill_tokens or not all(seq.active for seq, _ in batch.work):
                return None
        if free and not self._grow(scheduler, free):
            return None
        if free:
            batch = Batch(work=[(seq, 1) for seq in free], decode_tokens=len(free))
            batch.decode_context = sum(seq.computed + 1 for seq in free)
            for seq in free:
                seq.in_flight = True
            self.launch(batch, now)
        heap, step_seconds, pp = self._in_flight, self._perf.step_function, self._perf.pp
        size = config.block_size
        # Each batch's tokens are applied to its sequences lazily: when one of them needs a block (as
        # `schedule` would take it, at the same launch) and at the end.
        batches = {id(batch): _Round(batch, size) for _, _, batch in heap}
        while heap and heap[0][0] < until:
            finish, _, batch = heap[0]
            flight = batches[id(batch)]
            if flight.left == 0:
                break  # its next completion finishes a sequence: left to `complete`
            heapq.heappop(heap)
            now = finish
            flight.left -= 1
            flight.made += 1
            flight.pending += 1
            if flight.pending > flight.room:
                flight.apply()
                if not self._grow(scheduler, flight.group):
                    for seq in flight.group:
                        seq.in_flight = False
                    break  # the next `schedule` preempts: left to it
                flight.room = flight.room_of(size)
            batch.decode_context += flight.size
            duration = step_seconds(float(flight.size), float(batch.decode_context), 0.0, 0.0)
            start = max(now, self._entry_free_at)  # `launch`, inline
            self._entry_free_at = start + duration / pp
            heapq.heappush(heap, (start + duration, self._launched, batch))
            self._launched += 1
        for flight in batches.values():
            flight.apply()
        return now, [(flight.group, flight.made) for flight in batches.values() if flight.made]

    @staticmethod
    def _grow(scheduler: Scheduler, group: list[EngineSequence]) -> bool:
        """The block each sequence of a decode batch needs for its next token, taken in the running
        order as `schedule` takes them; False (nothing taken) where not all are free."""
        size = scheduler.config.block_size
        needing = [seq for seq in group if seq.computed + 1 > size * len(seq.blocks)]
        if len(needing) > scheduler.pool.available:
            return False
        for seq in needing:
            seq.blocks.append(scheduler.pool.allocate())
        return True


class _Round:
    """A decode batch taken round after round by `decode_rounds`: its sequences, the rounds it made, the
    tokens not yet applied to them, the rounds it may still make before one finishes, and how many more
    tokens its blocks hold (`room`: it needs one when `pending` passes it)."""

    __slots__ = ("group", "left", "made", "pending", "room", "size")

    def __init__(self, batch: Batch, block_size: int) -> None:
        self.group = [seq for seq, _ in batch.work]
        self.size = len(self.group)
        self.made = self.pending = 0
        self.left = min(seq.max_tokens - seq.generated for seq in self.group) - 1
        self.room = self.room_of(block_size)

    def room_of(self, block_size: int) -> int:
        """Rounds that may complete before the next launch needs a new block for one of the sequences."""
        return min(block_size * len(seq.blocks) - seq.computed - 1 for seq in self.group)

    def apply(self) -> None:
        """`complete`'s work for the rounds made since the last time: a token each, nobody finishing."""
        pending, self.pending = self.pending, 0
        if pending:
            for seq in self.group:  # (`last_token_at` is left, as `Scheduler.advance` leaves it)
                seq.computed += pending
                seq.generated += pending
