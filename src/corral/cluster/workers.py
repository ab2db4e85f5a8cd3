"""Gateway worker processes: `gateway.workers: N` gateways on one port, fed by one supervisor.

One Python process serves on one core. With N > 1, `corral up` keeps the supervisor (and the engines it
runs) in its own process and starts N gateway workers, each listening on the same host:port with
SO_REUSEPORT, so the kernel spreads connections over them. The pool:

- reserves the port first (a bound, not listening, SO_REUSEPORT socket: "port in use" fails before any
  replica starts, and port 0 resolves once for all workers);
- serves a local control socket: a worker that connects gets the spec and its index, then every change of
  the replica set as a snapshot (`routing/sync.py`), so workers never probe the engines themselves; and
  relays each worker's prefix placements to the others (`Router.share_placements`), so that every worker's
  prefix index knows where every worker sent each prompt;
- restarts a worker that dies (with backoff), and stops them all with SIGTERM (they drain in-flight
  requests for `gateway.shutdown_grace`).

Shared state lives where every worker reaches it: rate limits in Redis (a spec with workers > 1 must say
`limits.backend: redis`), keys and usage in the store, and metrics in prometheus_client's multiprocess
files (PROMETHEUS_MULTIPROC_DIR), which any worker's `/metrics` sums into one view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from corral.cluster.runtime import die_with_parent
from corral.routing import ReplicaSet
from corral.routing.sync import replica_snapshot

__all__ = ["WorkerError", "WorkerPool"]

logger = logging.getLogger(__name__)

# a worker's line: its placements of one event-loop turn (up to 256 hashes a request) can pass the default
# 64 KB of asyncio's stream reader
_LINE_LIMIT = 64 * 1024 * 1024
_MOST_UNREAD = 2 * _LINE_LIMIT  # bytes a worker may leave unread on its control connection (_send)
_PUBLISH_S = 0.2  # how often the replica set is compared with the last snapshot sent
_START_TIMEOUT_S = 60.0
_BACKOFF_MAX_S = 30.0
_PLACEMENTS = b'{"placements":'  # a worker's routing placements (routing/router.py), relayed to the others
_CALLS = ("apply", "drain", "drain_node", "rollout_action")  # what a worker may ask the reconciler
# A worker reports twice a second (cli/worker.py); one silent this long is hung (its event loop blocked,
# its process alive): its last queues and requests in flight no longer count
_REPORT_STALE_S = 2.0
_COUNTERS = ("arrived", "batch_arrived")  # a worker's figures that count up (a hung worker's still count)
_LIVE = ("batch_in_flight", "batch_pending")  # its batch runner's figures of now


class WorkerError(RuntimeError):
    """The workers could not start (the port, or a worker that exited before listening)."""


@dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    listening: asyncio.Event = field(default_factory=asyncio.Event)
    restarts: int = 0


class WorkerPool:
    """Starts, feeds, restarts and stops the gateway worker processes."""

    def __init__(
        self,
        replicas: ReplicaSet,
        spec: dict[str, Any],
        count: int,
        logs: str,
        shutdown_grace: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._replicas = replicas
        self._spec = spec
        self._count = count
        self._logs = logs  # the workers' log level and format, as corral up's: "info:auto"
        self._grace = shutdown_grace
        self._workers = [_Worker(i) for i in range(count)]
        self._dir = Path(tempfile.mkdtemp(prefix="corral-workers-"))
        self._metrics_dir = self._dir / "metrics"
        self._metrics_dir.mkdir()
        self._reserved: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._snapshot = b""
        self._stopping = False
        self._calls: set[asyncio.Task[None]] = set()  # workers' apply/drain calls being answered
        # the latest announcement of the cluster settings ("") and of each model (its name), in the order
        # they were last made: what every (re)connecting worker is told (`_replayed`)
        self._announced: dict[str, bytes] = {}
        self.port: int | None = None
        self.control: Any = None  # answers the workers' control calls (cluster.reconcile.Reconciler)
        self._reports: dict[int, dict[str, Any]] = {}  # each worker's latest queues and replica counts
        self._reported_at: dict[int, float] = {}  # when each came (`clock`)
        self._clock = clock
        self._totals: dict[str, list[int]] = {}  # replica id → [served, failed] over every worker, ever

    @property
    def control_path(self) -> Path:
        return self._dir / "control.sock"

    def reserve(self, host: str, port: int) -> int:
        """Hold host:port for the workers; the port (resolved when 0). OSError when it is taken."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        self._reserved = sock
        self.port = int(sock.getsockname()[1])
        self._spec["gateway"]["port"] = self.port
        return self.port

    async def start(self) -> None:
        """Start every worker and wait until each listens; WorkerError when one cannot."""
        await self.serve_control()
        self._tasks.append(asyncio.create_task(self._publish(), name="worker-publish"))
        for worker in self._workers:
            await self._spawn(worker)
        started = [asyncio.create_task(self._until_listening(w)) for w in self._workers]
        try:
            await asyncio.gather(*started)
        except BaseException:
            for task in started:
                task.cancel()
            raise
        for worker in self._workers:
            self._tasks.append(asyncio.create_task(self._keep(worker), name=f"worker-{worker.index}"))
        logger.info("%d gateway workers listening on port %s", self._count, self.port)

    async def serve_control(self) -> None:
        """Listen on the control socket (workers connect to it as they start)."""
        self._snapshot = replica_snapshot(self._replicas)
        self._server = await asyncio.start_unix_server(
            self._connected, path=str(self.control_path), limit=_LINE_LIMIT
        )

    async def stop(self) -> None:
        """SIGTERM every worker (they drain), SIGKILL those still running after the grace period."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = [w.process for w in self._workers if w.process and w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(self._ended(process) for process in running))  # (side by side: one grace)
        if self._server is not None:
            self._server.close()
        if self._reserved is not None:
            self._reserved.close()
        for path in sorted(self._dir.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        self._dir.rmdir()

    async def _ended(self, process: asyncio.subprocess.Process) -> None:
        """The worker drained and exited within the grace period, else killed."""
        try:
            await asyncio.wait_for(process.wait(), self._grace + 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def _spawn(self, worker: _Worker) -> None:
        worker.listening.clear()
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "corral.cli",
            "gateway-worker",
            "--control",
            str(self.control_path),
            "--index",
            str(worker.index),
            env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self._metrics_dir)},
            preexec_fn=die_with_parent() if sys.platform == "linux" else None,
        )

    async def _until_listening(self, worker: _Worker) -> None:
        assert worker.process is not None
        exited = asyncio.create_task(worker.process.wait())
        listening = asyncio.create_task(worker.listening.wait())
        try:
            done, _ = await asyncio.wait(
                {exited, listening}, timeout=_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            exited.cancel()
            listening.cancel()
        if listening not in done:
            code = worker.process.returncode
            why = (
                f"exited with code {code}" if code is not None else f"not listening in {_START_TIMEOUT_S:g}s"
            )
            raise WorkerError(f"gateway worker {worker.index} {why}")

    async def _keep(self, worker: _Worker) -> None:
        """Restart the worker whenever it exits, after a backoff that grows with restarts in a row."""
        while not self._stopping:
            assert worker.process is not None
            code = await worker.process.wait()
            self._forget_metrics(worker.process.pid)
            self._reports.pop(worker.index, None)  # its queue and requests in flight died with it
            self._reported_at.pop(worker.index, None)
            self._count_requests()
            if self._stopping:
                return
            worker.restarts += 1
            delay = min(_BACKOFF_MAX_S, 0.5 * 2 ** min(worker.restarts - 1, 6))
            logger.warning("gateway worker %d exited (%s); restarting in %.1fs", worker.index, code, delay)
            await asyncio.sleep(delay)
            try:
                await self._spawn(worker)  # (its exited process stays until a spawn succeeds: tried again)
            except OSError as exc:  # (no process could be made: fork's EAGAIN, out of memory)
                logger.error("gateway worker %d could not be started: %s", worker.index, exc)
                continue
            try:
                await self._until_listening(worker)
                worker.restarts = 0
            except WorkerError as exc:  # hung before listening: killed, and started again
                logger.warning("%s; killing it", exc)
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()

    def _forget_metrics(self, pid: int) -> None:
        """A dead worker's live gauges leave the sum; its counters stay (they count what it served)."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self._metrics_dir))  # type: ignore[no-untyped-call]

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's control connection: hello → config, the replica set as it is now and the replayed
        announcements (`replayed` in the config: how many lines, for the worker to take before it listens)
        → changes."""
        try:
            hello = orjson.loads(await reader.readline())
            worker = self._workers[int(hello["worker"])]
            replay = self._replayed()
            config = {
                "spec": self._spec,
                "worker": worker.index,
                "workers": self._count,
                "logs": self._logs,
                "metrics_dir": str(self._metrics_dir),
                "replayed": replay.count(b"\n"),  # (one line each)
            }
            try:  # the replica set as it is, not the last published: that is up to _PUBLISH_S old
                self._publish_changes()
            except Exception:  # (the last one published stands; the pool's loop goes on)
                logger.exception("the replica set could not be made for gateway worker %d", worker.index)
            worker.writer = writer  # from here on it gets every change (no await before the first write)
            writer.write(orjson.dumps(config) + b"\n" + self._snapshot + b"\n" + replay)
            await writer.drain()
            while line := await reader.readline():
                if line.startswith(_PLACEMENTS):  # for the other workers' prefix indexes, as it is
                    self._relay(worker, line)
                    continue
                message = orjson.loads(line)
                if message.get("listening"):
                    worker.listening.set()
                elif "report" in message:
                    self._take_report(worker.index, message["report"])
                elif "call" in message:
                    call = asyncio.create_task(self._answer(writer, message))
                    self._calls.add(call)  # held while it runs (the loop keeps only weak references)
                    call.add_done_callback(self._calls.discard)
        except (ValueError, KeyError, IndexError, ConnectionError) as exc:
            logger.warning("gateway worker control connection failed: %s", exc)
        finally:
            writer.close()

    def _relay(self, sender: _Worker, line: bytes) -> None:
        for worker in self._workers:
            if worker is not sender:
                _send(worker, line)

    def announce_cluster(self, settings: dict[str, Any]) -> None:
        """Tell every worker (and each that connects later) new live cluster settings."""
        self._announce("", orjson.dumps({"cluster_settings": settings}) + b"\n")

    def announce_model(self, settings: dict[str, Any]) -> None:
        """Tell every worker (and each that connects later) a new model's gateway settings."""
        self._announce(f"model:{settings['name']}", orjson.dumps({"model_settings": settings}) + b"\n")

    def _announce(self, key: str, line: bytes) -> None:
        self._announced.pop(key, None)  # (the latest goes last: replayed in the order they were made)
        self._announced[key] = line
        for worker in self._workers:
            _send(worker, line)

    def _replayed(self) -> bytes:
        """The announcements a (re)connecting worker is told: the latest cluster settings and each model's
        latest settings, in the order they were made; a model removed since is left out (the worker does
        not serve it), unless the spec the workers start from has it: then its last settings (its adapters
        and tokenizer let go) undo what that spec says of it."""
        served = {f"model:{m}" for m in self._replicas.models()}
        served |= {f"model:{m['name']}" for m in self._spec.get("models", ())}
        for key in [k for k in self._announced if k and k not in served]:
            del self._announced[key]
        return b"".join(self._announced.values())

    def pressure(self) -> dict[str, dict[str, float]]:
        """The workers' queues summed per model (the oldest wait is the longest of them), of the workers
        that reported lately (a hung one's arrivals so far still count: they are a counter, not now); the
        replicas' counts in flight are taken again without a hung one's."""
        fresh = self._fresh()
        if len(fresh) < len(self._reports):
            self._count_requests()
        total: dict[str, dict[str, float]] = {}
        for worker, report in self._reports.items():
            for model, queue in report["queues"].items():
                into = total.setdefault(model, {"queued": 0, "oldest_wait_s": 0.0, "arrived": 0})
                for key in _COUNTERS:  # (a batch runner's figures too, in a worker that runs one)
                    into[key] = into.get(key, 0) + queue.get(key, 0)
                if worker in fresh:
                    into["queued"] += queue.get("queued", 0)
                    into["oldest_wait_s"] = max(into["oldest_wait_s"], queue.get("oldest_wait_s", 0.0))
                    for key in _LIVE:
                        into[key] = into.get(key, 0) + queue.get(key, 0)
        return total

    def _take_report(self, worker: int, report: dict[str, Any]) -> None:
        """A worker's latest report. Served and failed requests add up over time (a restarted worker
        counts from zero again: what it reports then is all new); the rest is the latest of each."""
        previous = self._reports.get(worker, {"replicas": {}})["replicas"]
        for rid, (_, served, failed, _) in report["replicas"].items():
            was = previous.get(rid, [0, 0, 0, 0])
            total = self._totals.setdefault(rid, [0, 0])
            total[0] += served - was[1] if served >= was[1] else served
            total[1] += failed - was[2] if failed >= was[2] else failed
        self._reports[worker] = report
        self._reported_at[worker] = self._clock()
        self._count_requests()

    def _fresh(self) -> set[int]:
        """The workers that reported within _REPORT_STALE_S. (A hung one's report is kept, not counted as
        now: its served and failed requests add up from it when it reports again.)"""
        now = self._clock()
        return {w for w in self._reports if now - self._reported_at.get(w, now) <= _REPORT_STALE_S}

    def _count_requests(self) -> None:
        """Each replica's counts over the workers, into the supervisor's replica set (the autoscaler and
        rollout health checks read them there); in flight, of the workers that reported lately."""
        live: dict[str, list[int]] = {}
        fresh = self._fresh()
        for report in (r for w, r in self._reports.items() if w in fresh):
            for rid, (outstanding, _, _, pending) in report["replicas"].items():
                into = live.setdefault(rid, [0, 0])
                into[0] += outstanding
                into[1] += pending
        known = set()
        for replica in self._replicas:
            known.add(replica.id)
            replica.outstanding, replica.pending_prefill = live.get(replica.id, (0, 0))
            replica.served, replica.failures = self._totals.get(replica.id, (0, 0))
        for rid in set(self._totals) - known:  # drained replicas: their ids never come back
            del self._totals[rid]

    async def _answer(self, writer: asyncio.StreamWriter, call: dict[str, Any]) -> None:
        """Run a worker's control call on this process's reconciler (or, `counts`, read the summed
        replica counts); reply on its socket."""
        from corral.config import ClusterSpec

        reply: dict[str, Any] = {"reply": call["id"]}
        try:
            name, args = call["call"], dict(call["args"])
            if name == "counts":  # the status page's: this process's sums of the workers' reports
                reply["result"] = {
                    r.id: [r.outstanding, r.pending_prefill, r.served, r.failures, r.capacity or 0]
                    for r in self._replicas
                }
            elif self.control is None:
                raise ValueError("this corral runs no reconciler")
            elif name not in _CALLS:
                raise ValueError(f"unknown control call {name!r}")
            else:
                if name == "apply":
                    args["wanted"] = ClusterSpec.model_validate(args["wanted"])
                reply["result"] = await getattr(self.control, name)(**args)
        except KeyError as exc:
            reply.update(error="not_found", message=str(exc.args[0] if exc.args else exc))
        except ValueError as exc:
            reply.update(error="invalid", message=str(exc))
        except Exception as exc:  # the worker's admin request must get an answer, whatever happened here
            logger.exception("control call %s failed", call.get("call"))
            reply.update(error="failed", message=f"{type(exc).__name__}: {exc}")
        if not writer.is_closing():
            writer.write(orjson.dumps(reply) + b"\n")

    async def _publish(self) -> None:
        """Send the replica set to every worker when it changed. A round that fails is logged (once while
        it keeps failing the same way) and the next goes on: the workers keep the last snapshot and are
        sent the next one that can be made, rather than never one again."""
        failing = ""
        while True:
            await asyncio.sleep(_PUBLISH_S)
            try:
                self._publish_changes()
            except Exception as exc:  # (a supervisor loop: it must go on)
                if repr(exc) != failing:
                    failing = repr(exc)
                    logger.exception("the replica set could not be sent to the gateway workers")
                continue
            if failing:
                failing = ""
                logger.info("the replica set is sent to the gateway workers again")

    def _publish_changes(self) -> None:
        snapshot = replica_snapshot(self._replicas)
        if snapshot == self._snapshot:
            return
        self._snapshot = snapshot
        for worker in self._workers:
            _send(worker, snapshot + b"\n")


def _send(worker: _Worker, line: bytes) -> None:
    """A line to a worker's control connection, unless the worker has stopped reading it: past
    _MOST_UNREAD bytes waiting (placements relayed under load come at megabytes a second) it is taken for
    hung: its connection is closed and its process killed (the pool starts it again), not fed until the
    supervisor runs out of memory."""
    writer = worker.writer
    if writer is None or writer.is_closing():
        return
    waiting = writer.transport.get_write_buffer_size()
    if waiting > _MOST_UNREAD:
        logger.error(
            "gateway worker %d reads nothing of its control connection (%d bytes wait): stopping it",
            worker.index,
            waiting,
        )
        writer.close()
        if worker.process is not None and worker.process.returncode is None:
            worker.process.kill()
        return
    writer.write(line)
