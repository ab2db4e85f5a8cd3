"""vLLM's scheduler as a model: continuous batching over paged KV blocks with automatic prefix caching.

The same code drives the simulated engine (in real time) and the planner (in virtual time), so their
answers agree by construction. Modelled after vLLM V1:

- every step has a token budget (`max_num_batched_tokens`) and at most `max_num_seqs` running sequences;
  running sequences are served first (one token each for decodes, a chunk for prefills: chunked prefill),
  then waiting ones are admitted in arrival order while budget, sequence slots and KV blocks allow;
- KV is allocated in blocks of `block_size` tokens; full prompt blocks are hashed (chained with their
  prefix) and stay cached after their sequence ends until the space is needed (LRU eviction), so a new
  prompt that shares a prefix skips computing it;
- when a running sequence needs a block and none is free, the most recently admitted sequence is preempted
  (its blocks freed, recomputed later), as vLLM's recompute preemption does.

`reserve_whole` models TensorRT-LLM's default capacity policy instead (`GUARANTEED_NO_EVICT`): a sequence is
admitted only when the KV for its whole life (prompt and every output token) can be reserved, so nobody is
ever preempted and a closed loop beyond the cache's sequences waits in the queue for a finished one.

The virtual clocks (the planner, the validation traces) spend most steps in long stretches where the batch
is the same decode-only batch step after step; `decode_run` finds such a stretch and `advance` takes it in
one go, leaving the scheduler exactly as stepping through it would (tests/perf/test_scheduler.py).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "Batch",
    "BlockPool",
    "DecodeRun",
    "EngineSequence",
    "Scheduler",
    "SchedulerConfig",
    "block_hashes",
]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_blocks: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    reserve_whole: bool = False  # admit only with KV for prompt + max_tokens (TensorRT-LLM's default)


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Chained hashes of each full block of `tokens`: equal only when the whole prefix (and the salt, as
    vLLM's `cache_salt` starts a prompt's chain) is equal."""
    hashes, parent = [], 0 if salt is None else hash(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass(slots=True, eq=False)
class EngineSequence:
    """One request inside the engine."""

    id: int
    prompt_len: int
    max_tokens: int
    arrival: float
    hashes: list[int] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    registered: int = 0  # leading blocks cached as this sequence's (see Scheduler._register)
    tokens: Sequence[int] = ()  # the prompt's token ids, where KV events are published (the simulator)
    first_token_at: float | None = None
    finished_at: float | None = None
    in_flight: bool = False  # in a batch still going through the pipeline
    active: bool = False  # in the running set
    last_token_at: float | None = None
    preemptions: int = 0
    others: int = 0  # the other requests in flight when it arrived (the planner's per-stream overhead)

    @property
    def pending(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return self.prompt_len + self.generated - self.computed

    @property
    def finished(self) -> bool:
        return self.generated >= self.max_tokens


class BlockPool:
    """Fixed KV blocks; cached (hashed) blocks with no user stay reusable until evicted, oldest first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._fresh = 0  # blocks from here on were never taken: handed out first, in order
        self._free: deque[int] = deque()  # blocks given back with no cached content, in that order
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.evicted: list[int] | None = None  # where recorded (the simulator's KV events): evicted hashes

    @property
    def available(self) -> int:
        return self.num_blocks - self._fresh + len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def allocate(self) -> int:
        if self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
        elif self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of.pop(block)
            del self._by_hash[block_hash]
            if self.evicted is not None:
                self.evicted.append(block_hash)
        self._refs[block] = 1
        return block

    def lookup(self, block_hash: int) -> int | None:
        """A cached block holding this prefix, now referenced by the caller; None on a miss."""
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1
        return block

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def register(self, block: int, block_hash: int) -> bool:
        """Cache `block` as holding `block_hash` unless another block does; whether it now does."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
            return True
        return self._by_hash.get(block_hash) == block

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # the tail of a sequence is evicted before its shared prefix
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)


@dataclass(slots=True)
class Batch:
    """What one step computes: (sequence, tokens) pairs and the totals the step time depends on."""

    work: list[tuple[EngineSequence, int]]
    decode_tokens: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0


@dataclass(frozen=True)
class DecodeRun:
    """Steps that would each be one decode-only batch of the same sequences: step j (from 0) decodes
    `sequences` tokens over `context + j * sequences` of KV. `allocations`: (step, index in the running
    list) of each KV block the run takes, in the order stepping would take them."""

    steps: int
    sequences: int
    context: int
    allocations: list[tuple[int, int]]


class Scheduler:
    """Chooses each step's batch and applies its results."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks)
        self.waiting: deque[EngineSequence] = deque()
        self.running: list[EngineSequence] = []
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        # where recorded (`record_kv_events`): blocks newly cached, as (sequence, block index)
        self.stored: list[tuple[EngineSequence, int]] | None = None

    def record_kv_events(self) -> None:
        """Keep the blocks cached (`stored`) and evicted (`pool.evicted`) until the caller takes them."""
        self.stored, self.pool.evicted = [], []

    def add(self, seq: EngineSequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: EngineSequence) -> None:
        """Drop a sequence (its client went away), freeing its blocks."""
        if seq.active:
            self.running.remove(seq)
            seq.active = False
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    @property
    def kv_usage(self) -> float:
        return self.pool.used / self.pool.num_blocks

    def schedule(self) -> Batch | None:
        budget = self.config.max_num_batched_tokens
        batch = Batch(work=[])
        preempted = False
        index = 0
        running, work, size = self.running, batch.work, self.config.block_size
        while index < len(running) and budget > 0:
            seq = running[index]
            if seq.in_flight:  # pipeline parallelism: it is in an earlier batch still being computed
                index += 1
                continue
            computed = seq.computed
            count = min(seq.prompt_len + seq.generated - computed, budget)
            if computed + count > size * len(seq.blocks) and not self._grow(seq, computed + count):
                preempted = True
                if not seq.active:
                    continue  # it preempted itself; the next sequence now sits at this index
            if count == 1 and computed >= seq.prompt_len:  # a decode, as `_add_work` counts it, inline:
                work.append((seq, 1))  # most of a step's sequences are decodes, every step
                seq.in_flight = True
                batch.decode_tokens += 1
                batch.decode_context += computed + 1
            else:
                self._add_work(batch, seq, count)
            budget -= count
            index += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.computed == 0 and not seq.blocks:
                self._reuse_prefix(seq)
            count = min(seq.pending, budget)
            if not self._reserve(seq, seq.computed + count):
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.active = True
            self._add_work(batch, seq, count)
            budget -= count
        return batch if batch.work else None

    def complete(self, batch: Batch, now: float) -> list[EngineSequence]:
        """Apply a finished step: advance KV, sample tokens; the sequences that produced a token."""
        produced = []
        caching = self.config.enable_prefix_caching
        for seq, count in batch.work:
            seq.in_flight = False
            if not seq.active:
                continue  # aborted while its batch was in flight
            seq.computed += count
            if caching and seq.registered < len(seq.hashes):
                self._register(seq)
            if seq.computed == seq.prompt_len + seq.generated:  # nothing pending: a token is sampled
                seq.generated += 1
                seq.last_token_at = now
                if seq.first_token_at is None:
                    seq.first_token_at = now
                produced.append(seq)
                if seq.generated >= seq.max_tokens:
                    seq.finished_at = now
                    seq.active = False
                    self.running.remove(seq)
                    self._free(seq)
        return produced

    def decode_run(self, limit: int) -> DecodeRun | None:
        """The stretch of at most `limit` steps ahead in which every running sequence decodes, none
        finishes, no block runs out (the step that would preempt is left to `schedule`) and nobody
        waiting can be admitted; None where the next step is not in such a stretch. With nothing in
        flight only (one batch at a time); the caller caps `limit` before anything new arrives while
        nothing waits (a newcomer behind a blocked queue is blocked too)."""
        running, size = self.running, self.config.block_size
        if not running or len(running) > self.config.max_num_batched_tokens:
            return None
        steps = limit
        for seq in running:
            if seq.in_flight or seq.pending != 1 or seq.computed < seq.prompt_len:
                return None
            steps = min(steps, seq.max_tokens - seq.generated - 1)  # its last token ends the stretch
        if steps < 2:
            return None
        # Step j computes token `computed + j + 1` of each sequence: a new block where that crosses one.
        allocations = sorted(
            (j, i)
            for i, seq in enumerate(running)
            for j in range(size * len(seq.blocks) - seq.computed, steps, size)
        )
        if len(allocations) > self.pool.available:
            steps = allocations[self.pool.available][0]
            allocations = allocations[: bisect.bisect_left(allocations, (steps, -1))]
            if steps < 2:
                return None
        first_step = bisect.bisect_left(allocations, (1, -1))
        if self.waiting and not self._admission_blocked(self.pool.available - first_step):
            return None
        context = sum(seq.computed + 1 for seq in running)
        return DecodeRun(steps, len(running), context, allocations)

    def _admission_blocked(self, available: int) -> bool:
        """Whether the head of the queue cannot be admitted in any step of a decode run, `available`
        blocks being free after its first step's (fewer after later ones): no sequence slot, no token
        budget, or not enough KV. Where prefix caching is on, an admission try looks the head's prefix
        up (taking cached blocks): such steps are left to `schedule`."""
        running, config = self.running, self.config
        budget = config.max_num_batched_tokens - len(running)
        if len(running) >= config.max_num_seqs or budget <= 0:
            return True
        if config.enable_prefix_caching:
            return False
        head = self.waiting[0]
        tokens = self._admitted_tokens(head, head.computed + min(head.pending, budget))
        return math.ceil(tokens / config.block_size) - len(head.blocks) > available

    def advance(self, run: DecodeRun, steps: int | None = None) -> None:
        """Take the first `steps` (all by default) of `run`, found by `decode_run` with nothing changed
        since. `last_token_at` is not kept here: only the real-time simulator reads it, and it steps."""
        steps = run.steps if steps is None else steps
        for _, i in run.allocations[: bisect.bisect_left(run.allocations, (steps, -1))]:
            self.running[i].blocks.append(self.pool.allocate())
        for seq in self.running:
            seq.computed += steps
            seq.generated += steps
            self._register(seq)  # a prompt block whose twin an allocation just evicted is cached now

    def _register(self, seq: EngineSequence) -> None:
        """Cache the sequence's computed full prompt blocks. One whose hash another block holds is tried
        again each step (it is cached once that block is evicted); `registered` counts the leading
        blocks already cached as this sequence's, which stay so while it holds them."""
        if not self.config.enable_prefix_caching:
            return
        full = min(seq.computed, seq.prompt_len) // self.config.block_size
        stored, pool = self.stored, self.pool
        for i in range(seq.registered, min(full, len(seq.hashes), len(seq.blocks))):
            new = stored is not None and not pool.holds(seq.hashes[i])
            if pool.register(seq.blocks[i], seq.hashes[i]):
                if new:
                    stored.append((seq, i))  # type: ignore[union-attr]
                if i == seq.registered:
                    seq.registered += 1

    def _free(self, seq: EngineSequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.registered = 0

    def _add_work(self, batch: Batch, seq: EngineSequence, count: int) -> None:
        batch.work.append((seq, count))
        seq.in_flight = True
        if seq.computed >= seq.prompt_len and count == 1:
            batch.decode_tokens += 1
            batch.decode_context += seq.computed + 1
        else:
            batch.prefill_tokens += count
            batch.prefill_pairs += count * seq.computed + count * (count + 1) / 2

    def _reuse_prefix(self, seq: EngineSequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        self.prefix_queries += seq.prompt_len
        size = self.config.block_size
        usable = (seq.prompt_len - 1) // size  # at least one token is always computed
        for block_hash in seq.hashes[:usable]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            seq.blocks.append(block)
        seq.computed = len(seq.blocks) * size
        seq.cached_tokens = seq.computed
        self.prefix_hits += seq.computed

    def _admitted_tokens(self, seq: EngineSequence, tokens: int) -> int:
        """The KV tokens a waiting sequence reserves to be admitted with `tokens` computed by its step."""
        return seq.prompt_len + seq.max_tokens if self.config.reserve_whole else tokens

    def _reserve(self, seq: EngineSequence, tokens: int) -> bool:
        """Blocks for `tokens` of KV for a waiting sequence (its whole life with `reserve_whole`), without
        preempting anyone."""
        needed = math.ceil(self._admitted_tokens(seq, tokens) / self.config.block_size) - len(seq.blocks)
        if needed > self.pool.available:
            return False
        for _ in range(needed):
            seq.blocks.append(self.pool.allocate())
        return True

    def _grow(self, seq: EngineSequence, tokens: int) -> bool:
        """Blocks for `tokens` of KV for a running sequence, preempting the newest others if needed.

        False when something was preempted (the caller then admits nobody new this step); if `seq`
        itself had to go, it is no longer running.
        """
        needed = math.ceil(tokens / self.config.block_size) - len(seq.blocks)
        clean = True
        while needed > self.pool.available:
            victim = next(r for r in reversed(self.running) if r is seq or not r.in_flight)
            self._preempt(victim)
            clean = False
            if victim is seq:
                return False
        for _ in range(needed):
            seq.blocks.append(self.pool.allocate())
        return clean

    def _preempt(self, seq: EngineSequence) -> None:
        self.running.remove(seq)
        seq.active = False
        self._free(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
