"""Two rotations of one key at once, on SQLite (which ignores FOR UPDATE; pysqlite reads outside a
transaction) and PostgreSQL: one wins, the other is told of the conflict and changes nothing. Both used to
answer a new secret, one of which never worked. A barrier after each rotation's read makes both read the
same secret."""

from __future__ import annotations

import threading
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from corral.store import KeyStore, hash_key, open_database
from corral.store.keys import KeyRecord, RotationConflict


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'keys.db'}"
    return str(request.getfixturevalue("fresh_postgres"))


def test_of_two_rotations_at_once_one_wins_and_the_other_is_refused_changing_nothing(store_url: str) -> None:
    engine = open_database(store_url)
    keys = KeyStore(engine)
    original, record = keys.create("acme")
    both_read = threading.Barrier(2, timeout=3)
    paused: set[str] = set()

    @event.listens_for(engine, "after_cursor_execute")
    def _after_the_read(connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        me = threading.current_thread().name
        if me.startswith("rotation") and me not in paused and statement.lstrip().upper().startswith("SELECT"):
            paused.add(me)  # (its first read only)
            with suppress(threading.BrokenBarrierError):  # (a read that waits for the other's commit)
                both_read.wait()

    outcomes: dict[int, tuple[str, KeyRecord] | Exception | None] = {}

    def rotate(i: int) -> None:
        try:
            outcomes[i] = keys.rotate(record.id, 3600)
        except Exception as exc:  # (the outcome under test)
            outcomes[i] = exc

    threads = [threading.Thread(target=rotate, args=(i,), name=f"rotation-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    answered = [outcome for outcome in outcomes.values() if isinstance(outcome, tuple)]
    refused = [outcome for outcome in outcomes.values() if isinstance(outcome, RotationConflict)]
    assert (len(answered), len(refused)) == (1, 1), outcomes
    secret, answer = answered[0]
    found = keys.by_secret_hash(hash_key(secret))
    assert found is not None and found.id == record.id  # the winner's secret works
    assert keys.by_secret_hash(hash_key(original)) is not None  # the former one, within its grace
    stored = keys.get(record.id)
    assert stored is not None and stored.prefix == answer.prefix == secret[: len(answer.prefix)]
    engine.dispose()
