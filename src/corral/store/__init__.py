"""SQL storage (SQLAlchemy): SQLite file by default, PostgreSQL by URL. Keys, usage records, the audit trail,
files, stored responses, and the batch tables (their queue's logic is in batch/)."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect
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
from corral.store.schema import CORE_TABLES, StoreError, bring_forward, store_is_down
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
    "StoredResponse",
    "UsageRecord",
    "UsageStore",
    "hash_key",
    "normalise_url",
    "open_database",
    "open_store",
    "server_secret",
    "store_is_down",
]

logger = logging.getLogger(__name__)

# The spellings people copy from PostgreSQL's docs, Heroku or psql, and the driver corral ships (psycopg 3).
_POSTGRES_PREFIXES = ("postgres://", "postgresql://", "postgresql+psycopg2://", "postgres+psycopg://")
_POSTGRES = "postgresql+psycopg://"


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


def open_database(url: str, create: bool = True) -> Engine:
    """An engine for `url` with corral's tables (open_store's)."""
    return open_store(url, create).engine


def open_store(url: str, create: bool = True) -> OpenedStore:
    """The store at `url`, brought up to this corral's schema: the tables, columns and indexes an earlier
    corral's store lacks are added (bring_forward: safe beside that corral's gateways still running). With
    `create` (a gateway, `keys create`) a store that is not there is made, SQLite's file readable by its
    owner only; without it (the commands that only read) that is an error. Raises StoreError with one line
    saying what is wrong."""
    url = normalise_url(url)
    shown = _without_password(url)
    database = url.removeprefix("sqlite:///").split("?", 1)[0]  # (its file, without the URL's options)
    if url.startswith("sqlite:///") and database not in ("", ":memory:"):
        _sqlite_file(Path(database).expanduser(), create)
    try:
        engine = _engine(url)
        if not create and not CORE_TABLES <= set(inspect(engine).get_table_names()):
            raise StoreError(f"{shown} holds no corral store (its tables are missing)")
        new = bring_forward(engine)
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


def _engine(url: str) -> Engine:
    if not url.startswith("sqlite:///"):
        return create_engine(url, pool_pre_ping=True, connect_args=_connect_args(url))
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _wal(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers don't block the usage writer
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.close()

    return engine


def _connect_args(url: str) -> dict[str, object]:
    """A store that does not answer is reported within seconds, not after the OS's TCP timeout; its
    sessions count time in UTC (usage by day and month is grouped by the UTC date, as budgets count
    months, whatever zone the server runs in), unless the URL sets its own `options`."""
    if not url.startswith(_POSTGRES):
        return {}
    return {"connect_timeout": 5} | ({} if "options=" in url else {"options": "-c timezone=UTC"})


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
