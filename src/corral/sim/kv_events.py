"""The simulator's KV-cache events, published as vLLM publishes them (`engines/kv_events.py` reads both).

A ZMQ PUB socket sends, after each engine step that cached or evicted blocks, the topic (empty), an 8-byte
big-endian sequence number and a msgpack batch `[ts, events]`, each event a map tagged by `type` as vLLM
0.32's: `BlockRemoved` for the blocks evicted, then `BlockStored` (hashes, parent hash, token ids, block
size; for an adapter's request its `lora_id` and `lora_name`) per run of one sequence's newly cached
blocks. The simulator's block hashes are ints. As vLLM does, it binds an ipc:// endpoint (where corral's
supervisor has it publish) or one with a wildcard (`tcp://*:5557`), and connects to any other.
"""

from __future__ import annotations

import itertools
import time

import msgpack
import zmq

from corral.perf import Scheduler
from corral.sim.lora_engine import LoraScheduler

__all__ = ["KvEventPublisher", "offset_endpoint", "take_events"]

_SEND_HWM = 100_000  # batches queued for a slow subscriber before ZMQ drops them


class KvEventPublisher:
    """Publishes one simulated engine's cache changes; `publish` after each step."""

    def __init__(self, endpoint: str, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._seq = itertools.count()
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or "0.0.0.0" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        scheduler.record_kv_events()

    def publish(self) -> None:
        events = take_events(self._scheduler)
        if not events:
            return
        payload = msgpack.packb([time.time(), events])
        frames = [b"", next(self._seq).to_bytes(8, "big"), payload]
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # no subscriber's queue has room: the batch is dropped, as vLLM's would be
            pass

    def close(self) -> None:
        self._socket.close(linger=0)


def take_events(scheduler: Scheduler) -> list[dict[str, object]]:
    """The cache's changes since the last call (`Scheduler.record_kv_events` on), as vLLM's events:
    the blocks evicted, then one BlockStored per run of consecutive newly cached blocks of a sequence."""
    evicted, stored = scheduler.pool.evicted, scheduler.stored
    events: list[dict[str, object]] = []
    if evicted:
        events.append({"type": "BlockRemoved", "block_hashes": list(evicted), "medium": None})
        evicted.clear()
    if stored:
        size, start = scheduler.config.block_size, 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k][0] is stored[k - 1][0] and stored[k][1] == stored[k - 1][1] + 1:
                continue
            seq, first = stored[start]
            last = stored[k - 1][1]
            parent = seq.hashes[first - 1] if first else None
            tokens = list(seq.tokens[first * size : (last + 1) * size])
            adapter = scheduler.adapter_of(seq) if isinstance(scheduler, LoraScheduler) else None
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": seq.hashes[first : last + 1],
                    "parent_block_hash": parent,
                    "token_ids": tokens,
                    "block_size": size,
                    "lora_id": adapter.id if adapter is not None else None,
                    "medium": None,
                    "lora_name": adapter.name if adapter is not None else None,
                }
            )
            start = k
        stored.clear()
    return events


def offset_endpoint(endpoint: str, index: int) -> str:
    """The endpoint of the `index`-th replica of one `corral sim` process, as vLLM's data-parallel ranks':
    a TCP endpoint's port + index, another's (ipc://) name + `_dp<index>`."""
    if index == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{index}"
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + index}"
