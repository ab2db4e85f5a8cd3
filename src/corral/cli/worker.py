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
from collections.abc import Callable
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
        self._ended: str | None = None  # why no reply comes any more

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
        if self._ended is not None:
            raise ValueError(f"this gateway worker cannot ask the supervisor now: {self._ended}")
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
        try:
            if reply.get("error") == "not_found":
                future.set_exception(KeyError(reply["message"]))
            elif "error" in reply:  # the admin API answers it as a 400 with the message
                future.set_exception(ValueError(reply["message"]))
            else:
                future.set_result(reply["result"])
        except Exception as exc:  # (its caller is answered; the follower logs it)
            future.set_exception(ValueError(f"the control reply could not be read: {exc!r}"))
            raise

    def failed(self, call: object, why: str) -> None:
        """The reply to call `call` could not be read: its caller is answered with the error (the admin
        API's 400), not left waiting."""
        future = self._pending.pop(call, None) if isinstance(call, int) else None
        if future is not None and not future.done():
            future.set_exception(ValueError(f"the control reply could not be read: {why}"))

    def fail_all(self, why: str) -> None:
        """No reply comes any more (the control connection is gone): every call waiting is answered, and
        every later one at once."""
        self._ended = why
        for call in list(self._pending):
            self.failed(call, why)


async def _report(writer: asyncio.StreamWriter, queue: Any, replicas: Any) -> None:
    """Tell the pool what only this worker knows, twice a second: its queues (the autoscaler's pressure)
    and its counts per replica (requests in flight, served, failed, prompt tokens awaiting prefill)."""
    while True:
        await asyncio.sleep(_REPORT_S)
        counts = {r.id: [r.outstanding, r.served, r.failures, r.pending_prefill] for r in replicas}
        writer.write(orjson.dumps({"report": {"queues": queue.pressure(), "replicas": counts}}) + b"\n")


async def _follow(
    reader: asyncio.StreamReader, take: Callable[[bytes], None], remote: _RemoteControl, index: int
) -> None:
    """Take every line the pool sends (`take`: snapshots, settings, replies, placements), each on its own: one
    that cannot be taken is logged (a reply's caller answered with the error) and the next is read. However
    this ends (the socket closed, a line over the limit, a bug), it says so; its caller then stops the
    worker, which is restarted, rather than serving on a replica set nothing updates any more."""
    try:
        while line := await reader.readline():
            try:
                take(line)
            except Exception as exc:
                logger.exception("gateway worker %d: a control message could not be taken", index)
                with contextlib.suppress(Exception):  # (a line that is no JSON has no call to answer)
                    remote.failed(orjson.loads(line).get("reply"), f"{type(exc).__name__}: {exc}")
        logger.warning("gateway worker %d: the control socket closed; stopping", index)
    except asyncio.CancelledError:
        raise
    except BaseException:
        logger.exception("gateway worker %d: following the control socket failed; stopping", index)
        raise
    finally:
        remote.fail_all("the control connection ended")


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
    # the latest announcements (`corral apply`'s model and cluster settings since the spec it starts from),
    # taken before it listens: else its first requests went by the settings of that spec
    replayed = [await reader.readline() for _ in range(int(config.get("replayed", 0)))]
    router = router_for(spec, replicas)
    if workers > 1:  # every worker's prefix index learns every worker's placements
        router.share_placements(writer.write)
    remote = _RemoteControl(writer)
    parts = dataclasses.replace(
        gateway_parts_for(spec, Paths.from_env(), replicas), control=remote, cluster_counts=remote.counts
    )

    def take(line: bytes) -> None:
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

    for line in replayed:  # (one that cannot be taken is logged, as the follower does, and the next taken)
        try:
            take(line)
        except Exception:
            logger.exception("gateway worker %d: a replayed control message could not be taken", index)
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

    def ended(task: asyncio.Task[None]) -> None:
        """A task the worker lives by ended (it says why itself): the worker exits, the pool restarts it."""
        if not task.cancelled() and task.exception() is not None and task.get_name() != "worker-follow":
            logger.error("gateway worker %d: %s: %r; stopping", index, task.get_name(), task.exception())
        stop.set()

    follower = asyncio.create_task(_follow(reader, take, remote, index), name="worker-follow")
    reporter = asyncio.create_task(_report(writer, parts.queue, replicas), name="worker-report")
    for task in (follower, reporter):
        task.add_done_callback(ended)
    try:
        await stop.wait()
    finally:
        for task in (follower, reporter):
            task.cancel()
        await asyncio.gather(follower, reporter, return_exceptions=True)  # (each said why it ended)
        await gateway.stop()
        writer.close()
