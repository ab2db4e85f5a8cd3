"""Following an engine's KV-cache events: what its prefix cache holds, stores and evicts, as it happens.

vLLM publishes them with `--kv-events-config` (publisher `zmq`), and `corral sim` in the same format: a
ZMQ PUB socket sends, for each engine step that changed the prefix cache, three frames: the topic, an
8-byte big-endian sequence number, and a msgpack batch `[ts, [event, ...], data_parallel_rank?]` where an
event is a map tagged by `type` (msgspec's tagged structs, vLLM 0.32): `BlockStored` (`block_hashes`,
`parent_block_hash`, `token_ids`, `block_size`, …), `BlockRemoved` (`block_hashes`, …) or
`AllBlocksCleared`; earlier versions sent each event as an array, `["BlockStored", block_hashes, …]`, also
read. Block hashes are bytes (or ints, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). With data parallelism each
engine publishes on its own endpoint (`rank_endpoint`: a TCP one's port + its rank).

An engine corral launches on this machine publishes on an ipc:// socket in a directory of the supervisor's
that only its user may enter (0700), and the supervisor connects to it: no other user of the host can
publish into a replica's view (as any could to a TCP port on 127.0.0.1). A view takes batches of at most
`_MOST_MESSAGE_BYTES`, holds a bounded count of blocks, and applies a large batch in pieces, the event loop
running between them.

The supervisor follows each replica's events and writes what they say into the replica's load
(`EngineLoad.kv_cached_tokens`, `kv_evicted_tokens_total`, `kv_evicted_through`, `kv_cleared_total`), which
the prefix index follows (`routing/policy.py`): it forgets the blocks the engine must have evicted, and all
of a replica's blocks when its cache was emptied.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from corral.config.engine_flags import flag_name
from corral.engines.base import LaunchPlan
from corral.engines.load import EngineLoad

__all__ = ["KvCacheView", "KvEventFeed", "data_parallel_size", "kv_events_config", "rank_endpoint"]

logger = logging.getLogger(__name__)

_RECEIVE_HWM = 100_000  # batches queued in the socket before ZMQ drops (vLLM's publisher holds as many)
# The largest batch taken (ZMQ's MAXMSGSIZE: a publisher sending more is disconnected, its batch lost, and
# connected to anew: `KvEventFeed._reconnect`).
# One engine step's events: a 128k-token prefill's token ids and block hashes, stored and evicted, are
# 1-2 MB with vLLM; this is several times that, and decoding one holds the event loop for at most ~100 ms.
_MOST_MESSAGE_BYTES = 8 * 2**20
# Blocks a view holds at most, until it has learnt the engine's KV capacity (`stamp`): then twice that
# many blocks (per data-parallel rank). A view past its bound is no longer the engine's cache: emptied.
_MOST_BLOCKS = 2**21  # (some 400 MB of 32-byte hashes; an H200 holds ~250,000 16-token blocks of a 1B model)
_CAPACITY_SLACK = 2
_MOST_HASH_BYTES = 64  # vLLM's block hashes: 32 bytes (sha256) or 64-bit ints
_PIECE = 8_192  # block hashes applied between two turns of the event loop
# The socket an engine publishes on, in the feed's private directory: named with "inproc" since vLLM's
# publisher takes a data-parallel rank's endpoint as that name + `_dp<rank>` for such an endpoint (an
# ipc:// one without it it refuses for ranks past 0); it binds any ipc:// endpoint, as the simulator does.
_SOCKET_NAME = "kv-events.inproc"
_MOST_DIR_CHARS = 80  # an ipc:// path is at most 107 bytes (a Unix socket's): the directory, name, suffix
_PLAIN_PATH = re.compile(r"[A-Za-z0-9/._-]+")  # (the endpoint goes into JSON and a str.format template)


def kv_events_config(endpoint: str) -> str:
    """vLLM's `--kv-events-config` value publishing to `endpoint`, braces doubled for the runtime's
    `str.format` of the command line."""
    return '{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "' + endpoint + '"}}'


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank `rank` of an engine told to publish to `endpoint` publishes, as vLLM's
    `ZmqEventPublisher.offset_endpoint_port`: a TCP endpoint's port + the rank, another's name + `_dp<rank>`
    (rank 0: `endpoint`)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return f"{head}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class KvCacheView:
    """One replica's prefix cache as its events tell: the blocks it holds now (with when each was cached),
    the tokens it has evicted, the newest cache time among the blocks it evicted (an engine's cache frees
    least recently freed blocks first, so every block freed before that is gone), and how often it was
    emptied (a reset, the engine restarting: a publisher whose sequence starts over, or batches lost: a gap
    in the sequence). Kept across the replica's restarts, so that its counts only grow.

    `ranks`: the engine's data-parallel ranks, each publishing its own sequence (a batch naming another
    rank is refused); None: one publisher, whatever rank its batches name (a running server's)."""

    def __init__(self, ranks: int | None = 1) -> None:
        self.blocks: dict[Any, float] = {}  # the engine's own block hash (bytes or int) → when cached
        self.block_size = 0  # tokens per block, from the stored blocks' events
        self.evicted_blocks = 0
        self.evicted_through = 0.0
        self.cleared = 0
        self.most_blocks = _MOST_BLOCKS  # (the engine's capacity, once known: `stamp`)
        self._ranks = ranks
        self._last_seq: dict[int, int] = {}  # per data-parallel rank

    def apply(self, seq: int, payload: bytes) -> None:
        """One published message: its sequence number and msgpack batch (ValueError, and the view as it
        was, for a batch whose time is no finite number or that names a rank the engine has not)."""
        for _ in self._apply(seq, payload):
            pass

    async def take(self, seq: int, payload: bytes) -> None:
        """`apply`, a large batch in pieces with the event loop running between them."""
        for _ in self._apply(seq, payload):
            await asyncio.sleep(0)

    def restarted(self) -> None:
        """The replica's engine started again: its cache is empty and its sequence starts over."""
        self._last_seq.clear()
        self.clear()

    def clear(self) -> None:
        self.blocks.clear()
        self.cleared += 1

    def stamp(self, load: EngineLoad) -> EngineLoad:
        """`load` with what the events say (and the view's bound from the engine's KV capacity, if told)."""
        if load.kv_capacity_tokens and self.block_size:
            per_rank = -(-load.kv_capacity_tokens // self.block_size)
            self.most_blocks = min(_MOST_BLOCKS, _CAPACITY_SLACK * per_rank * (self._ranks or 1))
        return dataclasses.replace(
            load,
            kv_cached_tokens=len(self.blocks) * self.block_size,
            kv_evicted_tokens_total=self.evicted_blocks * self.block_size,
            kv_evicted_through=self.evicted_through,
            kv_cleared_total=self.cleared,
        )

    def _apply(self, seq: int, payload: bytes) -> Iterator[None]:
        """Apply the batch, yielding between pieces of it."""
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)  # (tuples: faster)
        at, events = float(batch[0]), batch[1]
        if not math.isfinite(at):  # (a block cached at +inf, once evicted, would be every block's frontier)
            raise ValueError(f"a batch stamped {at}")
        if not isinstance(events, (tuple, list)):
            raise TypeError(f"a batch whose events are a {type(events).__name__}")
        rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else 0
        if self._ranks is None:
            rank = 0  # (one publisher: one sequence)
        elif not 0 <= rank < self._ranks:
            raise ValueError(f"a batch of rank {rank} from an engine of {self._ranks} data-parallel ranks")
        last = self._last_seq.get(rank)
        if last is not None and seq != last + 1:
            # at or before the last: the publisher started over (the engine restarted, its cache empty);
            # past the next: batches were lost (a full queue, a reconnect), and what they said is unknown
            self.clear()
        self._last_seq[rank] = seq
        work = 0
        for event in events:
            kind, hashes, size = _parts(event)
            for start in range(0, max(len(hashes), 1), _PIECE):
                piece = hashes[start : start + _PIECE]
                self._event(kind, piece, size, at)
                work += len(piece) + 1
                if work >= _PIECE:
                    work = 0
                    yield

    def _event(self, kind: Any, hashes: Sequence[Any], size: Any, at: float) -> None:
        if kind == "BlockStored":
            blocks = self.blocks
            for block in hashes:
                if type(block) is not int and (type(block) is not bytes or len(block) > _MOST_HASH_BYTES):
                    raise ValueError(f"a block hash that is a {type(block).__name__} (or too long)")
                blocks[block] = at
            if isinstance(size, int) and size > 0:
                self.block_size = size
            if len(blocks) > self.most_blocks:
                logger.warning(
                    "KV events tell of %d blocks cached, more than the engine holds (%d): following anew",
                    len(blocks),
                    self.most_blocks,
                )
                self.clear()
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


def _parts(event: Any) -> tuple[Any, Sequence[Any], Any]:
    """An event's kind, block hashes and block size."""
    if isinstance(event, dict):  # vLLM ≥ 0.11: a map tagged by "type"
        kind, hashes, size = event.get("type"), event.get("block_hashes") or (), event.get("block_size")
    else:  # array-like, as earlier versions sent: [tag, block_hashes, parent, token_ids, block_size, …]
        kind = event[0]
        hashes = event[1] if len(event) > 1 else ()
        size = event[4] if kind == "BlockStored" and len(event) > 4 else None
    if not isinstance(hashes, (tuple, list)):
        raise TypeError(f"block hashes that are a {type(hashes).__name__}")
    return kind, hashes, size


# what a batch of another shape raises (a map where a list goes, a number where events go)
_UNREADABLE = (ValueError, TypeError, IndexError, KeyError, AttributeError, msgpack.UnpackException)


class KvEventFeed:
    """One replica incarnation's subscription to its engine's KV events, owned by the supervisor.

    For an engine corral launches on this machine, the feed makes a directory only its user may enter and
    the plan's `kv_events_args` tell the engine to publish on an ipc:// socket there (`endpoint`; vLLM and
    the simulator bind an ipc:// endpoint), to which the feed connects, one socket per data-parallel rank
    (`rank_endpoint`); for a running server (`kv_events_urls`), the feed connects to its publishers. An
    engine launched on another node (Ray) is not followed: its routing keeps the index's own bound."""

    def __init__(self, context: zmq.asyncio.Context, plan: LaunchPlan, remote: bool) -> None:
        self.plan = plan
        self.endpoint: str | None = None  # where a launched engine publishes
        self.ranks: int | None = None  # its data-parallel ranks (a view's `ranks`)
        self._socket: zmq.asyncio.Socket | None = None
        self._private: str | None = None
        self._publishers: tuple[str, ...] = ()  # the endpoints connected to
        if plan.kv_events_urls:
            self._socket = self._subscriber(context)
            self._publishers = plan.kv_events_urls
            for url in self._publishers:
                self._socket.connect(url)
        elif plan.kv_events_args and not remote:
            self.ranks = max(1, plan.kv_events_ranks)
            self._private = _private_dir()
            self.endpoint = endpoint = f"ipc://{self._private}/{_SOCKET_NAME}"
            self._publishers = tuple(rank_endpoint(endpoint, rank) for rank in range(self.ranks))
            try:
                self._socket = self._subscriber(context)
                for publisher in self._publishers:
                    self._socket.connect(publisher)
            except BaseException:
                self.close()
                raise
            args = tuple(arg.replace("{events}", endpoint) for arg in plan.kv_events_args)
            self.plan = dataclasses.replace(plan, argv=(*plan.argv, *args))

    @property
    def active(self) -> bool:
        return self._socket is not None

    def view(self) -> KvCacheView:
        """A view of the engine this feed follows."""
        return KvCacheView(ranks=self.ranks)

    async def follow(self, view: KvCacheView, changed: Callable[[], None]) -> None:
        """Apply each batch to `view`, calling `changed` after each; runs until cancelled."""
        socket = self._socket
        if socket is None:
            return
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        reconnecting = asyncio.ensure_future(self._reconnect(socket, monitor))
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:  # vLLM's end-of-stream marker, sent as its publisher shuts down
                    continue
                try:
                    await view.take(seq, frames[2])
                except _UNREADABLE as exc:
                    logger.warning("unreadable KV event batch: %s", exc)
                changed()
        finally:
            reconnecting.cancel()
            await asyncio.gather(reconnecting, return_exceptions=True)
            with contextlib.suppress(zmq.ZMQError):
                socket.disable_monitor()
            monitor.close(linger=0)

    async def _reconnect(self, socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Connect anew to each publisher the socket is disconnected from: ZMQ gives up on one that sent a
        batch past `_MOST_MESSAGE_BYTES` (retrying only one whose connection broke; that retry is replaced).
        The batches lost leave a gap in the sequence: the view empties."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            endpoint = event["endpoint"].decode(errors="replace")
            if endpoint not in self._publishers or self._socket is not socket:
                continue
            logger.info(
                "KV events: disconnected from %s (a batch past %d bytes?); connecting again",
                endpoint,
                _MOST_MESSAGE_BYTES,
            )
            with contextlib.suppress(zmq.ZMQError):
                socket.disconnect(endpoint)
            socket.connect(endpoint)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            _MADE.discard(self._private)
            self._private = None

    @staticmethod
    def _subscriber(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, _MOST_MESSAGE_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        return socket


_MADE: set[str] = set()  # the directories this process made and has not removed: removed at its exit


@atexit.register
def _remove_made() -> None:
    """A feed never closed (a supervisor ended without stopping) leaves no directory behind at exit."""
    for path in list(_MADE):
        shutil.rmtree(path, ignore_errors=True)
    _MADE.clear()


def _private_dir() -> str:
    """A new directory only this user may enter (mode 0700), for an engine's ipc:// socket: in the temporary
    directory, else /tmp where that one's path is too long for a socket (or not plain)."""
    for parent in (None, "/tmp"):
        path = tempfile.mkdtemp(prefix="corral-kv-", dir=parent)
        if len(path) <= _MOST_DIR_CHARS and _PLAIN_PATH.fullmatch(path):
            os.chmod(path, 0o700)  # (mkdtemp's own mode; said again, as what the feed relies on)
            _MADE.add(path)
            return path
        os.rmdir(path)
    raise OSError("no directory for the engine's KV-event socket with a path short enough")


def data_parallel_size(engine_args: Sequence[str]) -> int:
    """vLLM's `--data-parallel-size` (or `-dp`) among `engine_args`; 1 when absent."""
    value = "1"
    for i, arg in enumerate(engine_args):  # (as vLLM's parser reads them: `_` as `-`, `--flag=value`)
        if flag_name(arg) not in ("--data-parallel-size", "-dp"):
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(engine_args):
            value = engine_args[i + 1]
    return max(1, int(value)) if value.isdigit() else 1  # (vLLM itself refuses a value that is no number)
