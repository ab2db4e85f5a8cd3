"""SQL storage (SQLAlchemy): SQLite file by default, PostgreSQL by URL. Keys and usage records."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event

from corral.store.keys import PRIORITIES, KeyRecord, KeyStore, hash_key
from corral.store.schema import Base
from corral.store.usage import UsageRecord, UsageStore

__all__ = ["PRIORITIES", "KeyRecord", "KeyStore", "UsageRecord", "UsageStore", "hash_key", "open_database"]


def open_database(url: str) -> Engine:
    """An engine for `url` with corral's tables created (SQLite folders are made as needed)."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url)

        @event.listens_for(engine, "connect")
        def _wal(dbapi_connection, _record):  # type: ignore[no-untyped-def]
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")  # readers don't block the usage writer
            cursor.execute("PRAGMA busy_timeout=5000")
            cursor.close()
    else:
        engine = create_engine(url, pool_pre_ping=True)
    Base.metadata.create_all(engine)
    return engine
