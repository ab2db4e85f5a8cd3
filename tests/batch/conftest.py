"""Fixtures the batch tests share."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from corral.batch import BatchStore
from corral.batch.queue_redis import RedisLines
from corral.store import open_database

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["sql", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatchStore]:
    """A batch store on SQLite, its lines in SQL or in Redis (under a prefix of its own, cleared after)."""
    engine = open_database(f"sqlite:///{tmp_path / 'queue.db'}")
    if request.param == "sql":
        yield BatchStore(engine)
        return
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    yield BatchStore(engine, RedisLines(REDIS, prefix=prefix))
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
