"""The batch runner: checks new batches, leases lines from the durable queue and runs them on spare
capacity only.

A batch is created `validating`; the runner checks the input of those waiting (batch/jobs.py `start` or
`fail`: its lines are queued, or it fails with an error per bad line, as OpenAI's does; a gateway that dies
while checking leaves it `validating`, and the next check takes it again). Checking runs in a task of its
own, one batch at a time, the tenant checked longest ago first: a 100 MB input takes seconds to check, and
the pass that commits results and leases lines does not wait for it. A batch whose check raises is tried
again after a backoff and, after a few permanent failures (retries.py), failed.

Each tick it looks at every model with batches in progress and takes as many lines as its ready replicas
have free slots, less the most slots interactive requests held (or waited for) at once over the last
`batch.reserve_window_s` and a headroom (`batch.headroom` slots a model): batch lines fill what
interactive traffic has recently left idle, and a burst like the recent ones finds free slots at once.
With several gateway workers, every worker runs a runner over its own share of the slots; the first one
alone checks new batches and keeps the queue (`manages`).
The autoscaler sizes for interactive demand only (a new replica's slots would be filled by batch lines
again): each runner tells it, per model, the slots its lines hold, the lines it sent and whether batches
are in progress (`pressure`); a model with batch lines to run keeps one replica, or wakes one from zero.
A line goes through the gateway's own pipeline (parse, authorize, queue at the lowest priority, route,
relay, settle: usage is recorded per line) and its result is committed under its lease (batch/jobs.py),
with the other results of its tick in one transaction (ticks are at least 50 ms apart). A line the
cluster could not take now (429, 502, 503) goes back to pending and is tried again after a backoff (2 s,
doubling), up to `batch.max_attempts`; a line the engine refused (its 4xx), timed out on (504) or that
the tenant's budget no longer covers is an error line, as is an answer that is not JSON (stored as a 502).
A line whose tenant's files quota is full (its files and its running batches' results, counted as they
are committed) is not run: it is an error line, `files_quota_exceeded`.
A commit the store refuses keeps its results for the next tick, and the pass goes on. Leases are renewed
while lines run; stopping hands the lines in hand back at once (their results, when they have one, are
committed first), with those a lease call under way took.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from corral.admission import Principal
from corral.admission.auth import SIGNED_IN, parents_of
from corral.batch.files import read_batch_input
from corral.batch.jobs import BatchRecord, BatchStore
from corral.batch.queue import BatchLine, LineResult
from corral.batch.retries import Retries
from corral.config import BatchSettings
from corral.protocol import PermissionDenied
from corral.routing import Replica, ReplicaSet
from corral.routing.adapters import AdapterCatalogue
from corral.store import BATCH_PRIORITY, KeyStore

if TYPE_CHECKING:
    from corral.admission.oidc import OIDCVerifier

__all__ = ["BatchRunner", "LineExecutor"]

logger = logging.getLogger(__name__)

_RETRY = frozenset({408, 429, 500, 502, 503})  # the cluster's state, not the line's fault
_HOUSEKEEPING_S = 2.0
_MIN_TICK_S = 0.05
_REFUSED_AT_INTAKE = frozenset({400, 404, 413, 422})  # a line's own fault, found before it is queued
_BACKOFF_S = 2.0  # a retried line waits this long, doubling with each try
_BACKOFF_MAX_S = 60.0
_SPENT = (b'"insufficient_quota"', b'"files_quota_exceeded"')  # a 429 that is not tried again


class LineExecutor(Protocol):
    """Runs one request as the gateway would (the pipeline)."""

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]: ...


def _forget(running: dict[asyncio.Task[None], int], task: asyncio.Task[None]) -> None:
    running.pop(task, None)


def _sequences(endpoint: str, body: bytes) -> int:
    """The sequences a line runs at once, as its replica counts them: an embeddings line's inputs, a
    completions line's prompts × `n`, a chat line's `n` (a Responses line: one)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 1
    if not isinstance(data, dict) or endpoint == "/v1/responses":
        return 1
    items = data.get("input" if endpoint == "/v1/embeddings" else "prompt")
    many = len(items) if isinstance(items, list) and items and not isinstance(items[0], int) else 1
    n = data.get("n")
    return many * (n if isinstance(n, int) and n > 0 else 1)


def _request_id(line: BatchLine) -> str:
    """A line's request id: its output line's and its usage rows', every attempt's (a retry's too)."""
    return "req_" + hashlib.blake2b(f"{line.batch_id}:{line.line}".encode(), digest_size=12).hexdigest()


class BatchRunner:
    """Owns the leases it takes; one per gateway that runs batches."""

    def __init__(
        self,
        store: BatchStore,
        executor: LineExecutor,
        keys: KeyStore,
        replicas: ReplicaSet,
        waiting: Callable[[], dict[str, int]],
        settings: BatchSettings,
        adapters: AdapterCatalogue | None = None,
        manages: bool = True,
        oidc: OIDCVerifier | None = None,
        check_retries: Retries | None = None,
    ) -> None:
        """`manages`: this runner also checks new batches and keeps the queue (finishes, expires, tidies);
        one runner a machine does (the first gateway worker), every worker's runs lines on its own share of
        the slots. `check_retries`: how a batch whose check raises is backed off, and when it is failed."""
        self._manages = manages
        self._check_retries = check_retries or Retries()
        self._to_check = asyncio.Event()  # set by a pass that found batches waiting to be checked
        self._checked: dict[str, float] = {}  # per tenant with batches waiting: when one was last checked
        self._held_bytes: dict[str, int] = {}  # per tenant of lines just leased: its files and results
        self._store = store
        self._adapters = adapters or AdapterCatalogue()  # an adapter's lines run on its base's replicas
        self._executor = executor
        self._keys = keys
        self._oidc = oidc  # (batches made by people signed in with the identity provider run as their tenant)
        self._replicas = replicas
        self._waiting = waiting
        self._settings = settings
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # per model: the lines running, each with the sequences it runs at once (replicas count those)
        self._running: dict[str, dict[asyncio.Task[None], int]] = {}
        self._leased: dict[tuple[str, int], BatchLine] = {}
        self._leasing = True  # until the gateway shuts down (`stop_leasing`)
        self._wake = asyncio.Event()
        self._seen: dict[str, deque[tuple[float, int]]] = {}  # per model: (when, interactive in flight)
        self._sent: dict[str, int] = {}  # per model: lines sent through the pipeline so far (tries each)
        self._in_progress: set[str] = set()  # models with batches in progress, at the last pass
        self._done: list[tuple[BatchLine, LineResult]] = []  # results not committed yet
        self._leasing_now: asyncio.Future[list[BatchLine]] | None = None  # a lease call under way

    def spare(self, model: str) -> int:
        """Lines this runner may start now for `model`: the ready replicas' free slots, less the most
        interactive requests held at once over the last `batch.reserve_window_s` (so a burst like the
        recent ones finds room at once) and `batch.headroom`, and never more than `batch.max_share` of
        the slots. With nothing else in flight or waiting,
        one line may always run (a model with one slot)."""
        base = self._base(model)
        ready = [r for r in self._replicas.ready(base) if r.breaker.allows()]
        if not ready:
            return 0
        slots = sum(r.capacity or 1 for r in ready)
        busy = sum(r.outstanding for r in ready)
        waiting = self._waiting().get(base, 0)
        mine = self._held(model, ready)
        peak = self._interactive_peak(model, max(0, busy + waiting - mine))
        share = int(slots * self._settings.max_share)  # requests pin to replicas (prefix affinity): spread
        spare = max(0, min(share, slots - self._settings.headroom - peak) - mine)
        if not spare and not mine and not busy and not waiting:
            return 1
        return spare

    def pressure(self) -> dict[str, dict[str, float]]:
        """Per served model (an adapter's lines count for its base), what the autoscaler leaves out of
        demand and what wakes a replica: `batch_in_flight`, the slots this runner's lines hold (queued or
        running); `batch_arrived`, the lines it sent so far (the gateway's queue counts them as arrivals);
        `batch_pending`, 1 while batches of the model are in progress (lines wait to run, even where no
        replica is ready to take them)."""
        figures: dict[str, dict[str, float]] = {}
        for model in self._running.keys() | self._sent.keys() | self._in_progress:
            into = figures.setdefault(
                self._base(model), {"batch_in_flight": 0.0, "batch_arrived": 0.0, "batch_pending": 0.0}
            )
            into["batch_in_flight"] += self._held(model, self._replicas.ready(self._base(model)))
            into["batch_arrived"] += self._sent.get(model, 0)
            if model in self._in_progress:
                into["batch_pending"] = 1.0
        return figures

    def _base(self, model: str) -> str:
        """The model whose replicas run `model`'s lines (an adapter's base)."""
        adapter = self._adapters.get(model)
        return adapter.base if adapter is not None else model

    def _held(self, model: str, ready: list[Replica]) -> int:
        """The slots this runner's lines of `model` hold: their sequences, as the `ready` replicas count
        them (up to one's slots)."""
        most = max((r.capacity or 1 for r in ready), default=None)
        running = self._running.get(model, {}).values()
        return sum(min(sequences, most) if most else sequences for sequences in running)

    def _interactive_peak(self, model: str, now_in_flight: int) -> int:
        """The most interactive requests in flight or waiting seen over the reserve window."""
        now = time.monotonic()
        seen = self._seen.setdefault(model, deque())
        seen.append((now, now_in_flight))
        while seen and seen[0][0] < now - self._settings.reserve_window_s:
            seen.popleft()
        return max(n for _, n in seen)

    async def run(self) -> None:
        """Until cancelled; then the lines in hand are given back. A store that fails is logged and tried
        again next tick (a supervisor loop)."""
        loop = asyncio.get_running_loop()
        next_housekeeping = loop.time()
        try:
            if self._manages and (dropped := await asyncio.to_thread(self._store.tidy)):
                logger.info("batch queue: dropped the lines of %d finished batches", dropped)
        except Exception:
            logger.exception("batch queue: tidying failed")
        helpers = [asyncio.create_task(self._renew(), name="batch-leases")]
        if self._manages:
            helpers.append(asyncio.create_task(self._check_batches(), name="batch-checks"))
        try:
            while True:
                await self._flush()  # (a store that fails keeps them: the rest of the pass goes on)
                try:
                    if self._manages and loop.time() >= next_housekeeping:
                        next_housekeeping = loop.time() + _HOUSEKEEPING_S
                        for batch_id in await asyncio.to_thread(self._store.housekeeping):
                            logger.info("batch %s finished", batch_id)
                    checking, models = await asyncio.to_thread(self._store.pending)
                    self._in_progress = set(models)
                    if checking:
                        self._to_check.set()  # (checked in a task of its own: this pass does not wait)
                    for model in models:
                        await self._start(model)
                except Exception:  # the store is down or a query failed: logged, tried again next tick
                    logger.exception("batch runner: a pass failed")
                await asyncio.sleep(_MIN_TICK_S)  # results and leases gathered per tick, not per line
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._settings.poll_s):
                        await self._wake.wait()
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await self._stop()

    async def _renew(self) -> None:
        """Renew the leases of the lines in hand every third of a lease, on a timer of its own: a pass
        that takes long (checking big input files, a slow store) does not let them lapse and run twice."""
        while True:
            await asyncio.sleep(self._settings.lease_s / 3)
            if not self._leased:
                continue
            try:
                await asyncio.to_thread(
                    self._store.renew, self.owner, list(self._leased.values()), self._settings.lease_s
                )
            except Exception:  # the store is down: tried again at the next third
                logger.exception("batch runner: renewing leases failed")

    async def _check_batches(self) -> None:
        """Check new batches, one at a time, in a task of its own: checking a 100 MB input takes seconds,
        and the pass that commits results and leases lines goes on meanwhile. Each time, the tenant whose
        batch was checked longest ago goes first (its oldest batch), so one tenant's many batches do not
        hold another's; a batch whose check raises is tried again after a backoff, and after
        `check_retries` permanent failures is failed (before, it was checked again every tick, for the
        day of its window). A supervisor loop: a store that fails is logged and tried at the next pass."""
        while True:
            await self._to_check.wait()
            self._to_check.clear()
            tried: set[str] = set()
            try:
                while (record := await self._next_to_check(tried)) is not None:
                    tried.add(record.id)
                    await self._check(record)
            except Exception:
                logger.exception("batch runner: checking new batches failed")

    async def _next_to_check(self, tried: set[str]) -> BatchRecord | None:
        """The batch to check next (none tried this round, none backed off), read afresh: a batch made
        meanwhile by a tenant not checked lately goes before another tenant's next."""
        waiting = await asyncio.to_thread(self._store.validating)
        self._check_retries.keep([record.id for record in waiting])
        tenants = {record.tenant for record in waiting}
        self._checked = {tenant: at for tenant, at in self._checked.items() if tenant in tenants}
        due = [r for r in waiting if r.id not in tried and self._check_retries.due(r.id)]
        return min(due, key=lambda r: (self._checked.get(r.tenant, -math.inf), r.created_at), default=None)

    async def _check(self, record: BatchRecord) -> None:
        """Check one batch; one whose check raises is backed off, or failed after its tries."""
        try:
            await self._validate(record)
        except Exception as exc:  # (logged; the other batches go on)
            if not self._check_retries.failed(record.id, exc):
                logger.warning("batch %s: checking it failed; tried again later", record.id, exc_info=True)
                return
            logger.error("batch %s: checking it failed again; failing it", record.id, exc_info=True)
            if not await self._give_up(record):
                return
        finally:
            self._checked[record.tenant] = time.monotonic()
        self._check_retries.forget(record.id)

    async def _give_up(self, record: BatchRecord) -> bool:
        """Fail a batch whose check kept raising; False where failing it failed too (tried again later)."""
        message = "The batch's input could not be checked, after several tries; the gateway's log says why."
        errors = [{"code": "validation_failed", "message": message, "param": None, "line": None}]
        try:
            await asyncio.to_thread(self._store.fail, record.id, errors)
        except Exception:
            logger.exception("batch %s: failing it failed too", record.id)
            return False
        return True

    async def _validate(self, batch: BatchRecord) -> None:
        """Queue the batch's lines, or fail it with what is wrong (each bad line named)."""
        content = await asyncio.to_thread(self._store.files.file_content, batch.tenant, batch.input_file_id)
        if content is None:
            message = f"The input file {batch.input_file_id} was deleted before the batch started."
            errors = [{"code": "file_not_found", "message": message, "param": "input_file_id", "line": None}]
            await asyncio.to_thread(self._store.fail, batch.id, errors)
            return
        served = {m: self._replicas.features(m).embeddings for m in self._replicas.models()}
        served.update((a.name, False) for a in self._adapters.all() if a.allows(batch.tenant))
        parsed, errors = await asyncio.to_thread(read_batch_input, content, batch.endpoint, served)
        if parsed is not None:
            errors = await self._model_refused(batch, parsed.model)
        if parsed is None or errors:
            await asyncio.to_thread(self._store.fail, batch.id, errors)
        elif await asyncio.to_thread(self._store.start, batch.id, parsed.model, parsed.lines):
            logger.info("batch %s: %d lines queued for %s", batch.id, len(parsed.lines), parsed.model)

    async def _model_refused(self, batch: BatchRecord, model: str) -> list[dict[str, Any]]:
        """The key that made the batch must still be active and allowed the model."""
        principal = await self._principal(batch.tenant, batch.key_id)
        if principal is None:
            message = "The API key that created this batch has been revoked."
            return [{"code": "invalid_api_key", "message": message, "param": None, "line": None}]
        try:
            adapter = self._adapters.get(model)
            if adapter is not None and not adapter.allows(principal.tenant):
                raise PermissionDenied(f"The model '{model}' does not exist on this server.")
            principal.check_model(model)
        except PermissionDenied as exc:
            return [{"code": exc.code, "message": exc.message, "param": "body.model", "line": None}]
        return []

    async def stop_leasing(self, *_: object) -> None:
        """The gateway is shutting down: lease no more lines (those running go on until `run` is
        cancelled as the app is cleaned up, once its HTTP requests are drained; what is then in hand is
        given back with its attempt undone). An aiohttp `on_shutdown` handler."""
        self._leasing = False

    async def _start(self, model: str) -> None:
        spare = self.spare(model) if self._leasing else 0
        if not spare:
            return
        leased = await self._lease(model, spare)
        await self._count_held({line.tenant for line in leased})
        for line in leased:
            if (line.batch_id, line.line) in self._leased:
                continue  # still running here (its lease had lapsed): not a second time
            self._leased[(line.batch_id, line.line)] = line
            task = asyncio.create_task(self._run(line, model), name=f"batch-line:{line.batch_id}:{line.line}")
            running = self._running.setdefault(model, {})
            running[task] = _sequences(line.endpoint, line.body)
            task.add_done_callback(partial(_forget, running))

    async def _count_held(self, tenants: set[str]) -> None:
        """The bytes the tenants of lines just leased hold (their files and their running batches' results
        so far), which each line's tenant is checked against as it starts. A store that fails keeps the
        last count (logged): the lines leased run all the same."""
        if not tenants:
            return
        running = {line.tenant for line in self._leased.values()} | tenants
        self._held_bytes = {t: held for t, held in self._held_bytes.items() if t in running}
        try:
            self._held_bytes.update(await asyncio.to_thread(self._store.files.bytes_held, tenants))
        except Exception:
            logger.warning("batch runner: counting the bytes tenants hold failed", exc_info=True)

    async def _lease(self, model: str, spare: int) -> list[BatchLine]:
        """Lease lines in a thread, shielded: cancelled meanwhile (the gateway stopping), the thread leases
        all the same, and `_stop` hands back what it took (else those lines would sit out their lease and
        lose an attempt)."""
        settings = self._settings
        lease = partial(self._store.lease, self.owner, model, spare, settings.lease_s, settings.max_attempts)
        self._leasing_now = asyncio.ensure_future(asyncio.to_thread(lease))
        lines = await asyncio.shield(self._leasing_now)  # (cancelled: left in `_leasing_now` for `_stop`)
        self._leasing_now = None
        return lines

    async def _run(self, line: BatchLine, model: str) -> None:
        key = (line.batch_id, line.line)
        try:
            request_id = _request_id(line)
            status, body = await self._answer(line, model, request_id)
            if _retry(status, body) and line.attempts < self._settings.max_attempts:
                backoff = min(_BACKOFF_MAX_S, _BACKOFF_S * 2 ** (line.attempts - 1))
                await asyncio.to_thread(self._store.release, self.owner, line, backoff)  # tried again later
            else:  # committed with the others at the next tick, in one transaction
                self._done.append((line, LineResult(status, body, request_id)))
                return
            self._leased.pop(key, None)
        except asyncio.CancelledError:
            raise  # stopping: the line stays in `_leased`, and `_stop` hands it back
        except Exception:  # a runner loop: logged; the line is given back for another try (bounded)
            logger.exception("batch line %s:%d failed unexpectedly", line.batch_id, line.line)
            self._leased.pop(key, None)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._store.release, self.owner, line, _BACKOFF_MAX_S)
        finally:
            self._wake.set()

    async def _answer(self, line: BatchLine, model: str, request_id: str) -> tuple[int, bytes]:
        """The line's answer: the engine's, or why it does not run (its key was revoked; its tenant's files
        quota is full with its files and its running batches' results, counted as the line was leased)."""
        principal = await self._principal(line.tenant, line.key_id)
        if principal is None:
            return 401, _error("The API key that submitted this batch has been revoked.", "invalid_api_key")
        quota = principal.max_file_bytes or self._settings.tenant_max_bytes
        if self._held_bytes.get(line.tenant, 0) >= quota:
            message = (
                f"This request was not run: the tenant's files quota ({quota:,} bytes) is full with its "
                "files and its running batches' results."
            )
            return 429, _error(message, "files_quota_exceeded", "rate_limit_error")
        self._sent[model] = self._sent.get(model, 0) + 1
        status, body = await self._executor.run_line(principal, line.endpoint, line.body, request_id)
        if status in _REFUSED_AT_INTAKE:  # never queued: no arrival the autoscaler should take off
            self._sent[model] -= 1  # (lines refused at once would blind it to interactive arrivals)
        return status, body

    async def _principal(self, tenant: str, key_id: str | None) -> Principal | None:
        """Who a batch runs as (at the lowest priority); None once its key is revoked. A batch a person
        signed in with the identity provider made runs as its tenant's people do, while the spec lists the
        tenant (auth.oidc.tenants: no one of an unlisted tenant signs in either)."""
        if key_id is None:
            return Principal(key_id=None, tenant=tenant, priority=BATCH_PRIORITY)
        oidc = self._oidc
        if key_id.startswith(SIGNED_IN):
            listed = oidc is not None and tenant in oidc.settings.tenants
            principal = (
                oidc.principal_of("batch", tenant, "user", None) if oidc is not None and listed else None
            )
        else:
            record = await asyncio.to_thread(self._keys.get, key_id)
            principal = None
            if record is not None and record.active:  # (its makers' budgets hold over its batches too)
                above = await asyncio.to_thread(self._keys.ancestors, record.parent) if record.parent else []
                principal = Principal.of(record, parents_of(record, above, oidc))
        if principal is None:
            return None
        return Principal(
            principal.key_id,
            principal.tenant,
            principal.models,
            max_concurrency=None,
            priority=BATCH_PRIORITY,
            monthly_token_budget=principal.monthly_token_budget,
            max_file_bytes=principal.max_file_bytes,  # (its results count against its files quota)
            role=principal.role,  # (a tenant-admin's month is its keys' too)
            parents=principal.parents,
        )

    async def _flush(self) -> None:
        """Commit the results gathered since the last tick; their lines leave this runner's hands. A store
        that fails is logged and the results kept for the next tick (their leases are renewed meanwhile);
        a result that cannot be stored is stored as the line's error (store/batch_rows.py `stored_result`),
        so no one line holds the others back."""
        done, self._done = self._done, []
        if not done:
            return
        try:
            await asyncio.to_thread(self._store.commit_many, self.owner, done)
        except asyncio.CancelledError:
            self._done = done + self._done  # `_stop` commits them
            raise
        except Exception:
            self._done = done + self._done
            logger.exception("batch runner: committing %d results failed; kept for the next tick", len(done))
            return
        for line, _ in done:
            self._leased.pop((line.batch_id, line.line), None)

    async def _stop(self) -> None:
        tasks = [t for running in self._running.values() for t in running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if (leasing := self._leasing_now) is not None:  # cancelled while leasing: what it took goes back
            with contextlib.suppress(Exception):
                for line in await leasing:
                    self._leased.setdefault((line.batch_id, line.line), line)
        await self._flush()  # results in hand are kept, not thrown away with their leases
        for line in list(self._leased.values()):
            try:
                # (a shutdown is not the line's failure: the attempt its lease counted is undone)
                await asyncio.to_thread(self._store.release, self.owner, line, undo_attempt=True)
            except Exception:  # the store is gone too: the lease runs out instead
                logger.exception("could not hand back batch line %s:%d", line.batch_id, line.line)
        self._leased.clear()


def _retry(status: int, body: bytes) -> bool:
    """The cluster could not take the line now (not a 504: the engine worked on it until the read
    timeout; not a spent monthly budget nor a full files quota: those stay spent)."""
    return status in _RETRY and not any(code in body for code in _SPENT)


def _error(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
