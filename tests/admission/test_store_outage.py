"""The store not answering, told from a query's own error: an outage (down, unreachable, failing over,
locked) is a 503 to retry and keys are served as last found; a bug is not hidden as one. The usage writer
retries an outage and writes a batch the store refuses record by record, so one bad record never holds
the others back. (The whole path through a gateway and a cut PostgreSQL: tests/chaos/test_stores.py.)"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from corral.admission import Authenticator
from corral.gateway.usage import UsageRecorder
from corral.protocol import StoreUnavailable, Unauthorized
from corral.store import KeyRecord, KeyStore, UsageRecord, UsageStore, hash_key, open_database, store_is_down

POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def raised(engine_url: str, query: str, **options: object) -> BaseException:
    engine = create_engine(engine_url, **options)  # type: ignore[arg-type]
    try:
        with engine.connect() as connection:
            connection.execute(text(query))
    except Exception as exc:
        return exc
    finally:
        engine.dispose()
    raise AssertionError(f"{query} did not fail")


def test_an_outage_is_told_from_a_query_s_own_error(tmp_path: Path) -> None:
    outages = [
        raised("postgresql+psycopg://postgres@127.0.0.1:1/test", "SELECT 1"),  # nobody listens
        raised(POSTGRES, "SET TRANSACTION READ ONLY; CREATE TEMP TABLE t (x int)"),  # the old primary
        raised(f"sqlite:///{tmp_path}/no/such/folder/c.db", "SELECT 1"),  # the file cannot be opened
    ]
    bugs = [
        raised(POSTGRES, "SELECT nope FROM nowhere"),
        raised(f"sqlite:///{tmp_path}/c.db", "SELECT nope FROM nowhere"),  # an OperationalError on SQLite
        raised(f"sqlite:///{tmp_path}/c.db", "SELEC 1"),
    ]
    assert [store_is_down(e) for e in outages] == [True] * 3, outages
    assert [store_is_down(e) for e in bugs] == [False] * 3, bugs
    assert not store_is_down(ValueError("not the store's"))


class FlakyKeys:
    """A key store that answers until `down` is set, then fails as an unreachable PostgreSQL does."""

    def __init__(self, records: dict[str, KeyRecord]) -> None:
        self.records = records
        self.down = False
        self.asked = 0

    def by_secret_hash(self, key_hash: str) -> KeyRecord | None:
        self.asked += 1
        if self.down:
            raise raised("postgresql+psycopg://postgres@127.0.0.1:1/test", "SELECT 1")
        return self.records.get(key_hash)


async def test_keys_are_served_as_last_found_while_the_store_is_down() -> None:
    now = datetime.now(UTC)
    known = KeyRecord("k1", "sk", "acme", "", (), None, None, None, "normal", None, now, None)
    revoked = replace(known, id="k2", revoked_at=now)
    short = replace(known, id="k3", expires_at=now + timedelta(seconds=0.3))  # a rotated-out secret's grace
    keys = FlakyKeys({hash_key("a"): known, hash_key("r"): revoked, hash_key("s"): short})
    told: list[str] = []
    auth = Authenticator(keys, open_access=False, ttl=0.05)  # type: ignore[arg-type]
    auth.on_store_error = lambda: told.append("down")
    for secret in ("a", "r", "s", "unknown"):  # looked up once while the store answers
        try:
            await auth.authenticate(f"Bearer {secret}")
        except Unauthorized:
            pass
    keys.down = True
    await asyncio.sleep(0.1)  # past the cache's ttl: each is asked again, and the store does not answer
    assert (await auth.authenticate("Bearer a")).key_id == "k1"
    for secret in ("r", "unknown"):  # a miss stays a miss
        with pytest.raises(Unauthorized):
            await auth.authenticate(f"Bearer {secret}")
    with pytest.raises(StoreUnavailable) as never_seen:
        await auth.authenticate("Bearer new")
    assert never_seen.value.status == 503 and never_seen.value.retry_after == 5
    asked = keys.asked
    await auth.authenticate("Bearer a")  # kept another ttl: not asked again on every request
    assert keys.asked == asked
    await asyncio.sleep(0.3)
    with pytest.raises(Unauthorized, match="expired"):  # the grace ends while the store is down too
        await auth.authenticate("Bearer s")
    assert len(told) >= 5
    keys.down = False
    await asyncio.sleep(0.1)
    with pytest.raises(Unauthorized):  # the store answers again: an unknown key is a 401, not a 503
        await auth.authenticate("Bearer new")


async def test_a_record_the_store_refuses_does_not_hold_the_others_back() -> None:
    """PostgreSQL refuses a replica name longer than its column: that record is dropped and counted, the
    rest of its batch written; a later batch is not held up."""
    usage = UsageStore(open_database(POSTGRES))
    tenant = f"poison-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC)

    def record(replica: str) -> UsageRecord:
        return UsageRecord(now, None, tenant, "m", 1, 1, None, 1.0, 200, replica, "chat")

    recorder = UsageRecorder(usage, flush_interval=0.05)
    for replica in ("r0", "x" * 300, "r1"):
        recorder.record(record(replica))
    await recorder.flush()
    recorder.record(record("r2"))
    await recorder.flush()
    (row,) = usage.report("tenant", tenant=tenant)
    assert (row["requests"], recorder.dropped, recorder.pending) == (3, 1, 0)


def test_a_rotated_out_secret_is_found_expiring_with_its_grace(tmp_path: Path) -> None:
    """Found by its former secret, a rotated key expires when the grace ends: served as last found while
    the store is down, it stops then too (not when the store comes back)."""
    keys = KeyStore(open_database(f"sqlite:///{tmp_path / 'c.db'}"))
    old, record = keys.create("acme")
    new, rotated = keys.rotate(record.id, grace_s=60) or ("", record)
    by_old, by_new = keys.by_secret_hash(hash_key(old)), keys.by_secret_hash(hash_key(new))
    assert by_old is not None and by_new is not None and by_new.expires_at is None
    assert by_old.expires_at == rotated.previous_until
