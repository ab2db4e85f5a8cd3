"""Following an engine's KV-cache events: what its prefix cache holds, stores and evicts, as it happens.

vLLM publishes them with `--kv-events-config` (publisher `zmq`), and `corral sim` in the same format: a
ZMQ PUB socket sends, for each engine step that changed the prefix cache, three frames: the topic, an
8-byte big-endian sequence number, and a msgpack batch `[ts, [event, ...], data_parallel_rank?]` where an
event is a map tagged by `type` (msgspec's tagged structs, vLLM 0.32): `BlockStored` (`block_hashes`,
`parent_block_hash`, `token_ids`, `block_size`, …), `BlockRemoved` (`block_hashes`, …) or
`AllBlocksCleared`; earlier versions sent each event as an array, `["BlockStored", block_hashes, …]`, also
read. Block hashes are bytes (or ints, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). With data parallelism each
engine publishes on its own port (the endpoint's port + its rank).

The supervisor follows each replica's events and writes what they say into the replica's load
(`EngineLoad.kv_cached_tokens`, `kv_evicted_tokens_total`, `kv_evicted_through`, `kv_cleared_total`), which
the prefix index follows (`routing/policy.py`): it forgets the blocks the engine must have evicted, and all
of a replica's blocks when its cache was emptied.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from corral.engines.base import LaunchPlan
from corral.engines.load import EngineLoad

__all__ = ["KvCacheView", "KvEventFeed", "data_parallel_size", "kv_events_config"]

logger = logging.getLogger(__name__)

_RECEIVE_HWM = 100_000  # batches queued in the socket before ZMQ drops (vLLM's publisher holds as many)
_BIND_TRIES = 20


def kv_events_config(endpoint: str) -> str:
    """vLLM's `--kv-events-config` value publishing to `endpoint`, braces doubled for the runtime's
    `str.format` of the command line."""
    return '{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "' + endpoint + '"}}'


class KvCacheView:
    """One replica's prefix cache as its events tell: the blocks it holds now (with when each was cached),
    the tokens it has evicted, the newest cache time among the blocks it evicted (an engine's cache frees
    least recently freed blocks first, so every block freed before that is gone), and how often it was
    emptied (a reset, or the engine restarting: a publisher whose sequence starts over). Kept across the
    replica's restarts, so that its counts only grow."""

    def __init__(self) -> None:
        self.blocks: dict[Any, float] = {}  # the engine's own block hash (bytes or int) → when cached
        self.block_size = 0  # tokens per block, from the stored blocks' events
        self.evicted_blocks = 0
        self.evicted_through = 0.0
        self.cleared = 0
        self._last_seq: dict[int, int] = {}  # per data-parallel rank

    def apply(self, seq: int, payload: bytes) -> None:
        """One published message: its sequence number and msgpack batch (ValueError, and the view as it
        was, for a batch whose time is no finite number)."""
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)  # (tuples: faster)
        at, events = float(batch[0]), batch[1]
        if not math.isfinite(at):  # (a block cached at +inf, once evicted, would be every block's frontier)
            raise ValueError(f"a batch stamped {at}")
        rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else 0
        last = self._last_seq.get(rank)
        if last is not None and seq <= last:  # the publisher started over: the engine restarted, empty
            self.clear()
        self._last_seq[rank] = seq
        self.apply_events(events, at)

    def apply_events(self, events: Sequence[Sequence[Any]], at: float) -> None:
        """One batch's events, published at `at`."""
        for event in events:
            self._event(event, at)

    def restarted(self) -> None:
        """The replica's engine started again: its cache is empty and its sequence starts over."""
        self._last_seq.clear()
        self.clear()

    def clear(self) -> None:
        self.blocks.clear()
        self.cleared += 1

    def stamp(self, load: EngineLoad) -> EngineLoad:
        """`load` with what the events say."""
        return dataclasses.replace(
            load,
            kv_cached_tokens=len(self.blocks) * self.block_size,
            kv_evicted_tokens_total=self.evicted_blocks * self.block_size,
            kv_evicted_through=self.evicted_through,
            kv_cleared_total=self.cleared,
        )

    def _event(self, event: Any, at: float) -> None:
        if isinstance(event, dict):  # vLLM ≥ 0.11: a map tagged by "type"
            kind, hashes, size = event.get("type"), event.get("block_hashes") or (), event.get("block_size")
        else:  # array-like, as earlier versions sent: [tag, block_hashes, parent, token_ids, block_size, …]
            kind = event[0]
            hashes = event[1] if len(event) > 1 else ()
            size = event[4] if kind == "BlockStored" and len(event) > 4 else None
        if kind == "BlockStored":
            blocks = self.blocks
            for block in hashes:
                blocks[block] = at
            if isinstance(size, int) and size > 0:
                self.block_size = size
        elif kind == "BlockRemoved":
            blocks, through = self.blocks, self.evicted_through
            for block in hashes:
                cached = blocks.pop(block, None)
                if cached is not None and cached > through:
                    through = cached
            self.evicted_through = through
            self.evicted_blocks += len(hashes)
        elif kind == "AllBlocksCleared":
            self.clear()


# what a batch of another shape raises (a map where a list goes, a number where events go)
_UNREADABLE = (ValueError, TypeError, IndexError, KeyError, AttributeError, msgpack.UnpackException)


class KvEventFeed:
    """One replica incarnation's subscription to its engine's KV events, owned by the supervisor.

    For an engine corral launches on this machine, the feed binds a SUB socket on 127.0.0.1 (one port per
    data-parallel rank) and the plan's `kv_events_args` tell the engine to connect its publisher there
    (vLLM connects rather than binds to an endpoint without a wildcard); for a running server
    (`kv_events_urls`), the feed connects to its publishers. An engine launched on another node (Ray) is not
    followed: its routing keeps the index's own bound."""

    def __init__(self, context: zmq.asyncio.Context, plan: LaunchPlan, remote: bool) -> None:
        self.plan = plan
        self._socket: zmq.asyncio.Socket | None = None
        if plan.kv_events_urls:
            self._socket = self._subscriber(context)
            for url in plan.kv_events_urls:
                self._socket.connect(url)
        elif plan.kv_events_args and not remote:
            self._socket = self._subscriber(context)
            endpoint = _bind_ports(self._socket, plan.kv_events_ranks)
            args = tuple(arg.replace("{events}", endpoint) for arg in plan.kv_events_args)
            self.plan = dataclasses.replace(plan, argv=(*plan.argv, *args))

    @property
    def active(self) -> bool:
        return self._socket is not None

    async def follow(self, view: KvCacheView, changed: Callable[[], None]) -> None:
        """Apply each batch to `view`, calling `changed` after each; runs until cancelled."""
        socket = self._socket
        if socket is None:
            return
        while True:
            frames = await socket.recv_multipart()
            if len(frames) < 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq < 0:  # vLLM's end-of-stream marker, sent as its publisher shuts down
                continue
            try:
                view.apply(seq, frames[2])
            except _UNREADABLE as exc:
                logger.warning("unreadable KV event batch: %s", exc)
                continue
            changed()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    @staticmethod
    def _subscriber(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        return socket


def _bind_ports(socket: zmq.asyncio.Socket, ranks: int) -> str:
    """Bind `socket` on 127.0.0.1 at `ranks` consecutive free ports (rank r publishes to the first + r);
    the first one's endpoint."""
    for _ in range(_BIND_TRIES):
        first = socket.bind_to_random_port("tcp://127.0.0.1")
        bound = [first]
        try:
            for rank in range(1, ranks):
                socket.bind(f"tcp://127.0.0.1:{first + rank}")
                bound.append(first + rank)
        except zmq.ZMQError:
            for port in bound:
                socket.unbind(f"tcp://127.0.0.1:{port}")
            continue
        return f"tcp://127.0.0.1:{first}"
    raise OSError(f"no {ranks} consecutive free ports for the KV events of a data-parallel engine")


def data_parallel_size(engine_args: Sequence[str]) -> int:
    """vLLM's `--data-parallel-size` (or `-dp`) among `engine_args`; 1 when absent."""
    value = "1"
    for i, arg in enumerate(engine_args):
        if arg in ("--data-parallel-size", "-dp") and i + 1 < len(engine_args):
            value = engine_args[i + 1]
        elif arg.startswith("--data-parallel-size="):
            value = arg.split("=", 1)[1]
    return max(1, int(value)) if value.isdigit() else 1  # (vLLM itself refuses a value that is no number)
