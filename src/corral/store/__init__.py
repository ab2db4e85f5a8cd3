"""SQL storage (SQLAlchemy): SQLite file by default, PostgreSQL by URL. Keys, usage records, the audit trail,
files, stored responses, and the batch tables (their queue's logic is in batch/)."""

from __future__ import annotations

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
from corral.store.schema import Base, StoreError, add_missing_columns, store_is_down
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
    "server_secret",
    "store_is_down",
]

# The spellings people copy from PostgreSQL's docs, Heroku or psql, and the driver corral ships (psycopg 3).
_POSTGRES_PREFIXES = ("postgres://", "postgresql://", "postgresql+psycopg2://", "postgres+psycopg://")
_POSTGRES = "postgresql+psycopg://"


def normalise_url(url: str) -> str:
    """`postgres://…` and `postgresql://…` mean PostgreSQL through psycopg 3; everything else as given."""
    for prefix in _POSTGRES_PREFIXES:
        if url.startswith(prefix):
            return _POSTGRES + url.removeprefix(prefix)
    return url


def open_database(url: str, create: bool = True) -> Engine:
    """An engine for `url` with corral's tables. With `create` (a gateway, `keys create`) SQLite folders and
    the tables are made as needed; without it (read-only commands) a store that is not there is an error.
    Raises StoreError with one line saying what is wrong."""
    url = normalise_url(url)
    shown = _without_password(url)
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///")).expanduser()
        if not create and not path.exists():
            raise StoreError(f"no corral store at {path} (nothing has been recorded there yet)")
        if create:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the store's folder {path.parent}: {exc.strerror}") from exc
    try:
        engine = _engine(url)
        if create:
            Base.metadata.create_all(engine)
            add_missing_columns(engine)
        elif not _CORE_TABLES <= set(inspect(engine).get_table_names()):  # (a store from before batches)
            raise StoreError(f"{shown} holds no corral store (its tables are missing)")
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
    return engine


_CORE_TABLES = {"corral_api_keys", "corral_usage"}


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
