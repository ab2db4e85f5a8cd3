"""A PostgreSQL that is slow (a table locked, as VACUUM FULL or a stuck migration locks it) or gone silent
(a network that stops relaying): requests' key lookups and budget reads answer within seconds, through
the store-down path (a key served as last found, a 503), and a lookup never waits behind budget reads."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text

from corral.admission import Authenticator, BudgetTracker, Principal
from corral.protocol import NoCapacity, StoreUnavailable
from corral.store import KeyStore, StoreThreads, StoreTimeouts, UsageStore, open_store


async def test_a_locked_usage_table_holds_budget_reads_for_its_lock_timeout_and_key_lookups_not_at_all(
    fresh_postgres: str,
) -> None:
    """corral_usage locked: more budgeted keys ask than the threads can hold (asyncio's default executor held
    them all, with no timeout: a key lookup on the unlocked keys table waited for the lock's end). Each
    budget read gives up at the lock timeout (its key is refused 503 `budget_unavailable`: nothing is
    known of its month), and a key looked up meanwhile answers at once."""
    opened = open_store(fresh_postgres, timeouts=StoreTimeouts(statement_s=3, lock_s=1, pool_s=2))
    keys, usage = KeyStore(opened.engine), UsageStore(opened.engine)
    threads = StoreThreads(lookups=2, calls=3, wait_s=10)
    auth = Authenticator(keys, open_access=False, ttl=60, threads=threads)
    budget = BudgetTracker(usage, keys=keys, threads=threads)
    secret, _ = keys.create("other")
    asking = min(32, (os.cpu_count() or 1) + 4) + 2  # more than asyncio's default executor has threads
    budgeted = [Principal(f"k{i}", "acme", monthly_token_budget=1000) for i in range(asking)]
    watcher = create_engine(fresh_postgres, isolation_level="AUTOCOMMIT")
    with _locked(fresh_postgres, "corral_usage"):
        began = time.monotonic()
        reads = [asyncio.ensure_future(budget.reserve(p, 10)) for p in budgeted]
        try:
            await _until_waiting_on_locks(watcher, 3)  # budget reads blocked on the lock
            looked_up = time.monotonic()
            principal = await asyncio.wait_for(auth.authenticate(f"Bearer {secret}"), 5)
            assert principal.tenant == "other" and time.monotonic() - looked_up < 1.0
            outcomes = await asyncio.wait_for(asyncio.gather(*reads, return_exceptions=True), 30)
        finally:
            for read in reads:
                read.cancel()
        took = time.monotonic() - began
    assert all(isinstance(o, NoCapacity) and o.code == "budget_unavailable" for o in outcomes), outcomes
    assert took < 1.0 * (asking / 3 + 1) + 5, took  # each read at most its lock timeout, three at a time
    threads.close()
    watcher.dispose()
    opened.engine.dispose()


async def test_a_silent_network_answers_a_key_lookup_within_the_stores_wait(fresh_postgres: str) -> None:
    """The network to PostgreSQL stops relaying (a pooled connection's query waits for TCP to give up, 15
    minutes): a key looked up before is served as last found, one never looked up is a 503, each within
    the store threads' wait."""
    proxy = _Proxy()
    url = fresh_postgres.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    opened = open_store(url, timeouts=StoreTimeouts(statement_s=3, lock_s=1, pool_s=1))
    keys = KeyStore(opened.engine)
    known, _ = keys.create("acme")
    unknown, _ = keys.create("acme")
    threads = StoreThreads(lookups=2, calls=2, wait_s=1.0)
    auth = Authenticator(keys, open_access=False, ttl=0, threads=threads)  # (each request asks the store)
    try:
        assert (await auth.authenticate(f"Bearer {known}")).tenant == "acme"
        proxy.frozen.set()
        began = time.monotonic()
        assert (await asyncio.wait_for(auth.authenticate(f"Bearer {known}"), 10)).tenant == "acme"
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(auth.authenticate(f"Bearer {unknown}"), 10)
        assert time.monotonic() - began < 4.0
    finally:
        proxy.frozen.clear()  # (the stuck threads' queries go on and end)
        threads.close()
        opened.engine.dispose()
        proxy.close()


async def _until_waiting_on_locks(watcher: Engine, sessions: int) -> None:
    deadline = time.monotonic() + 10
    query = text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )

    while True:
        with watcher.connect() as connection:  # (on the loop: every thread may be held)
            waiting = int(connection.execute(query).scalar() or 0)
        if waiting >= sessions:
            return
        assert time.monotonic() < deadline, f"only {waiting} sessions wait on the lock"
        await asyncio.sleep(0.05)


class _locked:
    """`table` locked ACCESS EXCLUSIVE (as VACUUM FULL takes it) by another session while inside."""

    def __init__(self, url: str, table: str) -> None:
        self._engine = create_engine(url)
        self._table = table

    def __enter__(self) -> None:
        self._holder = self._engine.connect()
        self._holder.execute(text(f"LOCK TABLE {self._table} IN ACCESS EXCLUSIVE MODE"))

    def __exit__(self, *_: object) -> None:
        self._holder.rollback()
        self._holder.close()
        self._engine.dispose()


class _Proxy:
    """A TCP relay to 127.0.0.1:5432 that can be frozen (it stops relaying both ways, its sockets open)."""

    def __init__(self) -> None:
        self.frozen = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        for client, server in self._pairs():
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pairs(self) -> Iterator[tuple[socket.socket, socket.socket]]:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", 5432))
            self._sockets += [client, server]
            yield client, server

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.05)  # the bytes held: the peer hears nothing
                b.sendall(data)
        except OSError:
            pass
