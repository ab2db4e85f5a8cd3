"""`corral gateway-worker` (hidden): one of `gateway.workers` gateway processes, started by `corral up`.

It connects to the pool's control socket (cluster/workers.py), gets the spec and its index, builds the same
gateway `corral up` runs in one process, listens on the shared port with SO_REUSEPORT, and keeps its replica
set a mirror of the supervisor's snapshots. It drains and exits on SIGTERM/SIGINT or when the control
socket closes (the parent is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from corral.cli.app import FlagsCommand, app, run_async, setup_logging
from corral.config import ClusterSpec, Paths

logger = logging.getLogger(__name__)

_LINE_LIMIT = 64 * 1024 * 1024  # one snapshot is one line; replicas' log tails can make it long
_REPORT_S = 0.5


@app.command("gateway-worker", hidden=True, cls=FlagsCommand)
def gateway_worker(
    control: Annotated[Path, typer.Option(help="the worker pool's control socket")],
    index: Annotated[int, typer.Option(help="this worker's index")],
) -> None:
    """Run one gateway worker process (started by `corral up` when gateway.workers > 1)."""
    run_async(_work(control, index))


class _RemoteControl:
    """The admin API's control calls in a worker (apply, drains, rollout actions): asked of the reconciler
    in `corral up`'s process over the control socket (cluster/workers.py answers), replies matched by id."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next = 0
        self._counts: tuple[float, dict[str, list[int]]] | None = None  # (when, the last counts)
        self._counting: asyncio.Future[Any] | None = None

    async def drain(self, replica_id: str, grace_s: float) -> dict[str, object]:
        return dict(await self._call("drain", replica_id=replica_id, grace_s=grace_s))

    async def drain_node(self, node: str, grace_s: float) -> dict[str, object]:
        return dict(await self._call("drain_node", node=node, grace_s=grace_s))

    async def apply(self, wanted: ClusterSpec, grace_s: float) -> list[dict[str, object]]:
        return list(await self._call("apply", wanted=wanted.model_dump(mode="json"), grace_s=grace_s))

    async def rollout_action(self, model: str, action: str, grace_s: float = 60.0) -> dict[str, object]:
        return dict(await self._call("rollout_action", model=model, action=action, grace_s=grace_s))

    async def counts(self) -> dict[str, list[int]]:
        """Each replica's [outstanding, pending prefill tokens, served, failures, capacity] over all the
        workers (the pool sums the workers' reports, each up to half a second old). Asked at most once a
        report interval, one call at a time, however many status requests come (tenants may ask too)."""
        loop = asyncio.get_running_loop()
        if self._counts is not None and loop.time() - self._counts[0] < _REPORT_S:
            return self._counts[1]
        if self._counting is None or self._counting.done():
            self._counting = asyncio.ensure_future(self._call("counts"))
        counts = dict(await asyncio.shield(self._counting))  # (a caller that gives up leaves it running)
        self._counts = (loop.time(), counts)
        return counts

    async def _call(self, name: str, **args: Any) -> Any:
        self._next += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[self._next] = future
        self._writer.write(orjson.dumps({"call": name, "args": args, "id": self._next}) + b"\n")
        await self._writer.drain()
        return await future

    def answered(self, reply: dict[str, Any]) -> None:
        future = self._pending.pop(int(reply["reply"]), None)
        if future is None or future.done():
            return
        if reply.get("error") == "not_found":
            future.set_exception(KeyError(reply["message"]))
        elif "error" in reply:  # the admin API answers it as a 400 with the message
            future.set_exception(ValueError(reply["message"]))
        else:
            future.set_result(reply["result"])


async def _report(writer: asyncio.StreamWriter, queue: Any, replicas: Any) -> None:
    """Tell the pool what only this worker knows, twice a second: its queues (the autoscaler's pressure)
    and its counts per replica (requests in flight, served, failed, prompt tokens awaiting prefill)."""
    while True:
        await asyncio.sleep(_REPORT_S)
        counts = {r.id: [r.outstanding, r.served, r.failures, r.pending_prefill] for r in replicas}
        writer.write(orjson.dumps({"report": {"queues": queue.pressure(), "replicas": counts}}) + b"\n")


async def _work(control: Path, index: int) -> None:
    from corral.cli.gateway_spec import (
        apply_cluster_settings,
        apply_model_settings,
        gateway_parts_for,
        router_for,
    )
    from corral.gateway import GatewayServer
    from corral.routing import ReplicaSet
    from corral.routing.sync import apply_snapshot

    reader, writer = await asyncio.open_unix_connection(str(control), limit=_LINE_LIMIT)
    writer.write(orjson.dumps({"worker": index}) + b"\n")
    config = orjson.loads(await reader.readline())
    setup_logging(*config["logs"].split(":", 1))
    spec = ClusterSpec.model_validate(config["spec"])
    workers = int(config["workers"])
    replicas = ReplicaSet()
    apply_snapshot(replicas, await reader.readline(), index, workers)
    router = router_for(spec, replicas)
    if workers > 1:  # every worker's prefix index learns every worker's placements
        router.share_placements(writer.write)
    remote = _RemoteControl(writer)
    parts = dataclasses.replace(
        gateway_parts_for(spec, Paths.from_env(), replicas), control=remote, cluster_counts=remote.counts
    )
    metrics_dir = Path(config["metrics_dir"])
    gateway = GatewayServer(spec.gateway, router, parts, worker=index, metrics_dir=metrics_dir)
    await gateway.start()
    gc.freeze()  # long-lived objects out of the collector's generations (see cli/up.py)
    writer.write(orjson.dumps({"listening": gateway.port}) + b"\n")
    await writer.drain()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def follow() -> None:
        while line := await reader.readline():
            message = orjson.loads(line)
            if "placements" in message:
                router.learn_placements(message)
            elif "reply" in message:
                remote.answered(message)
            elif "model_settings" in message:
                apply_model_settings(router, parts, message["model_settings"])
            elif "cluster_settings" in message:
                apply_cluster_settings(router, parts, message["cluster_settings"])
            else:
                apply_snapshot(replicas, line, index, workers)
        logger.warning("gateway worker %d: the control socket closed; stopping", index)
        stop.set()

    follower = asyncio.create_task(follow())
    reporter = asyncio.create_task(_report(writer, parts.queue, replicas))
    try:
        await stop.wait()
    finally:
        for task in (follower, reporter):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await task
        await gateway.stop()
        writer.close()
