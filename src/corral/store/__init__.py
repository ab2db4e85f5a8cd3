"""SQL storage (SQLAlchemy): SQLite file by default, PostgreSQL by URL. Keys, usage records, the audit trail,
files, stored responses, and the batch tables (their queue's logic is in batch/).

The store is blocking: the gateway calls it from threads. A request's own calls (who its key is, its
budget, its stored response) run on `StoreThreads`, apart from asyncio's default executor where the admin
reports, the usage writer, the sweeps and the batch runner run. On PostgreSQL a gateway's store answers
within `StoreTimeouts` (a statement, a wait for a lock, a wait for a pooled connection), and TCP
keepalives end a connection whose network went silent: a locked table or a lost server is the store-down
path (a key served as last found, a 503), not a thread held for minutes."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Engine, create_engine, event, inspect, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from corral.store import batch_rows as _batch_rows  # noqa: F401  (its tables are created with the rest)
from corral.store.audit import AuditEntry, AuditLog
from corral.store.files import FileQuotaExceeded, FileStore, NewFile
from corral.store.keys import (
    BATCH_PRIORITY,
    PRIORITIES,
    ROLES,
    InvalidKey,
    KeyRecord,
    KeyStore,
    KeyUpdate,
    NewKey,
    hash_key,
)
from corral.store.responses import ResponseStore, StoredResponse
from corral.store.retention import Retention
from corral.store.schema import CORE_TABLES, StoreError, bring_forward, store_is_busy, store_is_down
from corral.store.secrets import server_secret
from corral.store.sessions import ConsoleSession, SessionStore
from corral.store.usage import UsageRecord, UsageStore

__all__ = [
    "BATCH_PRIORITY",
    "PRIORITIES",
    "ROLES",
    "AuditEntry",
    "AuditLog",
    "ConsoleSession",
    "FileQuotaExceeded",
    "FileStore",
    "InvalidKey",
    "KeyRecord",
    "KeyStore",
    "KeyUpdate",
    "NewFile",
    "NewKey",
    "OpenedStore",
    "ResponseStore",
    "Retention",
    "SessionStore",
    "StoreError",
    "StoreThreads",
    "StoreTimeouts",
    "StoredResponse",
    "UsageRecord",
    "UsageStore",
    "hash_key",
    "normalise_url",
    "open_database",
    "open_store",
    "server_secret",
    "store_is_busy",
    "store_is_down",
]

logger = logging.getLogger(__name__)

# The spellings people copy from PostgreSQL's docs, Heroku or psql, and the driver corral ships (psycopg 3).
_POSTGRES_PREFIXES = ("postgres://", "postgresql://", "postgresql+psycopg2://", "postgres+psycopg://")
_POSTGRES = "postgresql+psycopg://"
# A connection whose network went silent is ended by TCP: probes after 10 s idle, 5 s apart, 3 unanswered;
# data sent and not acknowledged for 20 s (libpq's parameters; tcp_user_timeout needs libpq 12, which
# psycopg[binary] bundles)
_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,
}

_P = ParamSpec("_P")
_T = TypeVar("_T")


_BACKLOG = 4  # calls a thread of a lane may have running or waiting before the lane refuses at once


@dataclass(frozen=True)
class StoreTimeouts:
    """How long a gateway's statement may run (`statement_s`) and wait for a lock (`lock_s`) on PostgreSQL,
    and how long a call waits for one of the engine's pooled connections (`pool_s`). Past them the call
    fails as a store that does not answer. The schema's changes when a store opens set them aside for
    their own transactions (bring_forward: a wait for another gateway's changes, an index's build)."""

    statement_s: float = 10.0
    lock_s: float = 5.0
    pool_s: float = 5.0


class StoreThreads:
    """The threads a request's own store calls run on, apart from asyncio's default executor (where the
    admin reports, the usage writer, the sweeps and the batch runner run): slow work there cannot keep a
    request waiting for a thread. Who a key or a console session is (`lookup`) has threads of its own
    beside the requests' other calls (`call`: budget reads, stored responses), so a locked usage table
    holds up budgets, not keys. A call is awaited `wait_s` at most, then StoreError (the store-down path):
    a network gone silent holds a thread until TCP gives up, never the request. Calls beyond the threads
    wait their turn, within `wait_s`. Built once with the gateway's parts; `close` at its shutdown (a call
    after it starts the threads again)."""

    def __init__(
        self, lookups: int = 4, calls: int = 6, wait_s: float | None = 10.0, *, shared: bool = False
    ) -> None:
        self._sizes = {"lookup": lookups, "call": calls}
        self._wait = wait_s
        self._shared = shared  # (asyncio's default executor instead)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        # calls given up on, running or waiting for a thread, by lane
        self._abandoned: dict[str, set[Future[Any]]] = {"lookup": set(), "call": set()}
        self._counting = threading.Lock()  # (a call's end is counted on its thread)

    @classmethod
    def default_executor(cls) -> StoreThreads:
        """Every call on asyncio's default executor, awaited as long as it takes (what a part built
        without threads of its own uses, as a test's)."""
        return cls(wait_s=None, shared=True)

    async def lookup(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`fn(*args, **kwargs)` on a lookup thread: who a key or a session is."""
        return await self._run("lookup", partial(fn, *args, **kwargs))

    async def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`fn(*args, **kwargs)` on one of the requests' other threads (budgets, stored responses)."""
        return await self._run("call", partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop the threads; calls not yet started are dropped (one running ends with its statement)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()

    async def _run(self, lane: str, call: Callable[[], _T]) -> _T:
        pool = self._pool(lane)
        if pool is None or self._wait is None:
            return await asyncio.get_running_loop().run_in_executor(pool, call)
        # A call given up on is not cancelled (it may be running, its thread held until TCP gives up): it
        # stays counted until it ends, and while `_BACKLOG` calls a thread are so a lane refuses at once
        # (behind a proxy that keeps a dead connection open, its threads stayed held and its queue grew for
        # good). Calls merely waiting their turn are not counted: a burst is served in turn.
        if len(self._abandoned[lane]) >= self._sizes[lane] * _BACKLOG:
            raise StoreError(f"the store has not answered {len(self._abandoned[lane])} calls given up on")
        submitted = pool.submit(call)
        within = asyncio.timeout(self._wait)
        try:
            async with within:
                return await asyncio.shield(asyncio.wrap_future(submitted))
        except TimeoutError:
            if not within.expired():  # (the call's own error)
                raise
            with self._counting:
                if not submitted.done():
                    self._abandoned[lane].add(submitted)
            submitted.add_done_callback(partial(self._ended, lane))
            raise StoreError(f"the store did not answer within {self._wait:g} s") from None

    def _ended(self, lane: str, call: Future[Any]) -> None:
        with self._counting:
            self._abandoned[lane].discard(call)

    def _pool(self, lane: str) -> ThreadPoolExecutor | None:
        if self._shared:
            return None
        pool = self._pools.get(lane)
        if pool is None:
            size = self._sizes[lane]
            pool = self._pools[lane] = ThreadPoolExecutor(size, thread_name_prefix=f"corral-store-{lane}")
        return pool


def normalise_url(url: str) -> str:
    """`postgres://…` and `postgresql://…` mean PostgreSQL through psycopg 3; everything else as given."""
    for prefix in _POSTGRES_PREFIXES:
        if url.startswith(prefix):
            return _POSTGRES + url.removeprefix(prefix)
    return url


@dataclass(frozen=True)
class OpenedStore:
    """A store opened: its engine, its URL as shown (any password masked), and whether it was new (corral
    made its tables now: nothing was recorded there before)."""

    engine: Engine
    shown: str
    new: bool


def open_database(url: str, create: bool = True, timeouts: StoreTimeouts | None = None) -> Engine:
    """An engine for `url` with corral's tables (open_store's)."""
    return open_store(url, create, timeouts).engine


def open_store(url: str, create: bool = True, timeouts: StoreTimeouts | None = None) -> OpenedStore:
    """The store at `url`, brought up to this corral's schema: the tables, columns and indexes an earlier
    corral's store lacks are added (bring_forward: safe beside that corral's gateways still running). With
    `create` (a gateway, `keys create`) a store that is not there is made, SQLite's file readable by its
    owner only; without it (the commands that only read) that is an error. `timeouts`: how long the
    engine's statements may take on PostgreSQL (a gateway's; None: as long as they take, a command's).
    Raises StoreError with one line saying what is wrong."""
    url = normalise_url(url)
    shown = _without_password(url)
    database = url.removeprefix("sqlite:///").split("?", 1)[0]  # (its file, without the URL's options)
    if url.startswith("sqlite:///") and database not in ("", ":memory:"):
        _sqlite_file(Path(database).expanduser(), create)
    try:
        engine = _engine(url, timeouts)
        if not create and not CORE_TABLES <= set(inspect(engine).get_table_names()):
            raise StoreError(f"{shown} holds no corral store (its tables are missing)")
        new = bring_forward(engine)  # (its changes lift the timeouts for themselves: schema.py)
    except NoSuchModuleError as exc:
        raise StoreError(
            f"unsupported store URL {shown}: use sqlite:///PATH or postgresql://USER@HOST/DB"
        ) from exc
    except (ArgumentError, ValueError) as exc:
        raise StoreError(f"malformed store URL {shown}: {exc}") from exc
    except ImportError as exc:
        raise StoreError(f"no driver for the store URL {shown}: use sqlite:/// or postgresql://") from exc
    except SQLAlchemyError as exc:
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise StoreError(f"cannot open the store at {shown}: {cause}") from exc
    return OpenedStore(engine, shown, new)


def _sqlite_file(path: Path, create: bool) -> None:
    """The store's file: made (with `create`) before SQLite opens it, readable and writable by its owner
    only, in a folder only its owner may enter where corral makes that too (SQLite gives the -wal and -shm
    files beside it the file's own mode); one that others may read is warned of."""
    if path.exists():
        _warn_if_shared(path)
        return
    if not create:
        raise StoreError(f"no corral store at {path} (nothing has been recorded there yet)")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create the store's folder {path.parent}: {exc.strerror}") from exc
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError as exc:
        raise StoreError(f"cannot create the store {path}: {exc.strerror}") from exc


def _warn_if_shared(path: Path) -> None:
    shared = [
        f"{p.name} ({stat.filemode(p.stat().st_mode)})"
        for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"))
        if p.exists() and p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    ]
    if shared:
        logger.warning(
            "the store %s can be read by others than its owner: %s. It holds stored responses, files, the "
            "audit trail, secrets and console sessions: make it its owner's alone (chmod 600 %s*)",
            path,
            ", ".join(shared),
            path,
        )


def _engine(url: str, timeouts: StoreTimeouts | None = None) -> Engine:
    if not url.startswith("sqlite:///"):
        pool = {"pool_timeout": timeouts.pool_s} if timeouts is not None else {}
        return create_engine(url, pool_pre_ping=True, connect_args=_connect_args(url, timeouts), **pool)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _wal(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers don't block the usage writer
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.close()

    return engine


def _connect_args(url: str, timeouts: StoreTimeouts | None) -> dict[str, object]:
    """A store that does not answer is reported within seconds, not after the OS's TCP timeout (a new
    connection's, and a silent one's: keepalives); its sessions count time in UTC (usage by day and month
    is grouped by the UTC date, as budgets count months, whatever zone the server runs in), and bound a
    statement and a lock's wait by `timeouts` (None: the server's own settings, unbounded by default).
    The URL's own `options` come after these: a setting it names is its (`?options=-c timezone=...`)."""
    if not url.startswith(_POSTGRES):
        return {}
    settings = {"timezone": "UTC"}
    if timeouts is not None:
        settings |= {
            "statement_timeout": f"{round(timeouts.statement_s * 1000)}",
            "lock_timeout": f"{round(timeouts.lock_s * 1000)}",
        }
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    given = make_url(url).query.get("options")
    for part in [given] if isinstance(given, str) else given or ():
        options += f" {part}"
    return {"connect_timeout": 5, **_KEEPALIVES, "options": options}


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
