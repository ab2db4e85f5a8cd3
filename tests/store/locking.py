"""What the SQLite write-lock tests share: a store whose file parts cost time to write or delete (as a
1 MiB part's pages on a busy disk), and another gateway worker writing while each part is written or
deleted, with a short busy timeout of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event, text

from corral.store import AuditEntry, AuditLog, open_database

PART_COST_S = 0.06  # each part written or deleted holds the write lock this long
BUSY_S = 0.4  # the other worker's busy timeout: a write waiting longer fails ('database is locked')
_TRIGGER = "CREATE TRIGGER part_cost BEFORE {operation} ON corral_file_parts BEGIN SELECT part_cost(); END"


class OtherWorker:
    """Another gateway worker (an engine of its own) that records an audit entry each time a part is
    written or deleted: the waits of the writes that went through, and the errors of those that failed."""

    def __init__(self, url: str) -> None:
        busy = f"PRAGMA busy_timeout={BUSY_S * 1000:.0f}"
        self.engine = _engine(url, lambda connection: connection.execute(busy))
        self.part_touched = threading.Event()
        self.waits: list[float] = []
        self.failures: list[str] = []

    def slow_parts(self, url: str, operation: str) -> Engine:
        """An engine whose `operation` (INSERT or DELETE) of a file part takes `PART_COST_S` with the write
        lock held, and tells this worker it is under way."""

        def cost() -> None:
            self.part_touched.set()
            time.sleep(PART_COST_S)  # (the disk's work on a part: what holds the lock, not a wait)

        engine = _engine(url, lambda connection: connection.create_function("part_cost", 0, cost))
        with engine.begin() as connection:
            connection.execute(text(_TRIGGER.format(operation=operation)))
        return engine

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Within the block, a write each time a part is touched (one at a time)."""
        done = threading.Event()
        thread = threading.Thread(target=self._write_while, args=(done,))
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _write_while(self, done: threading.Event) -> None:
        log = AuditLog(self.engine)
        while not done.is_set():
            if not self.part_touched.wait(0.05):
                continue
            self.part_touched.clear()
            began = time.monotonic()
            try:
                log.record(AuditEntry(actor="admin-key", role="admin", action="keys.create", status=201))
            except Exception as exc:  # (what the test reports)
                self.failures.append(f"after {time.monotonic() - began:.2f}s: {getattr(exc, 'orig', exc)}")
                continue
            self.waits.append(time.monotonic() - began)


def _engine(url: str, on_connect: Any) -> Engine:
    """`open_database`'s engine, `on_connect(dbapi_connection)` run on each connection it opens."""
    engine = open_database(url)
    event.listen(engine, "connect", lambda connection, _record: on_connect(connection))
    engine.dispose()  # (the connections opened before the listener are not reused)
    return engine
