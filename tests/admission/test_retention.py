"""Usage and audit records are kept as the spec says (`store.usage_retention_days`,
`store.audit_retention_days`): a gateway sweeps what is older at start (and hourly), keeps the rest, and
records on; usage is kept at least 32 days, so this calendar month's budget still counts every row. The same
sweep deletes stored responses past their expiry (`store.response_ttl_days`), off the requests' path."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from corral.config import SpecError, parse_spec
from corral.store import open_database
from corral.store.responses import ResponseRow, ResponseStore
from corral.store.schema import AuditRow, UsageRow
from tests.conftest import chat, cluster_of

SPEC = """
auth: {{open: true}}
store: {{url: "sqlite:///{db}", flush_interval: 0.1, usage_retention_days: 40, audit_retention_days: 5}}
models:
  - name: kept
    arch: llama-3.1-8b
    deployments: [{{engine: sim, gpu: l4, replicas: 1, time_scale: 100}}]
"""


def test_old_usage_and_audit_records_are_swept_and_the_rest_kept(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    engine = open_database(f"sqlite:///{db}")
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        for days in (100, 39):  # one past usage retention, one within it
            session.add(
                UsageRow(
                    at=now - timedelta(days=days), key_id=f"k{days}", model="kept", latency_ms=1, status=200
                )
            )
        for days in (6, 4):  # one past audit retention, one within it
            session.add(
                AuditRow(
                    at=now - timedelta(days=days), actor=f"a{days}", role="admin", action="x", status=200
                )
            )

        for name, expires in (("resp_gone", time.time() - 60), ("resp_kept", time.time() + 3600)):
            session.add(
                ResponseRow(
                    id=name,
                    tenant="acme",
                    model="kept",
                    created_at=time.time() - 7200,
                    expires_at=expires,
                    input_items="[]",
                    response="{}",
                    size=4,
                )
            )

    def responses() -> set[str]:
        with Session(engine) as session:
            return set(session.scalars(select(ResponseRow.id)))

    def usage_keys() -> set[str | None]:
        with Session(engine) as session:
            return set(session.scalars(select(UsageRow.key_id)))

    def audit_actors() -> set[str]:
        with Session(engine) as session:
            return set(session.scalars(select(AuditRow.actor)))

    with cluster_of(tmp_path, SPEC.format(db=db)) as cluster:
        deadline = time.monotonic() + 20
        while "k100" in usage_keys() or "a6" in audit_actors() or "resp_gone" in responses():
            assert time.monotonic() < deadline, "the sweep did not run"
            time.sleep(0.1)
        assert usage_keys() == {"k39"}
        assert audit_actors() == {"a4"}
        assert responses() == {"resp_kept"}  # an expired response swept with no /v1/responses request
        chat(cluster.url, "kept", "hello")  # and usage is recorded on
        while len(usage_keys()) < 2:
            assert time.monotonic() < deadline, "a request's usage was not recorded"
            time.sleep(0.1)
    engine.dispose()


def test_usage_is_kept_for_at_least_a_budgets_month() -> None:
    model = "models: [{name: m, arch: llama-3.1-8b, deployments: [{engine: sim, gpu: l4}]}]\n"
    with pytest.raises(SpecError, match="usage_retention_days"):
        parse_spec("store: {usage_retention_days: 31}\n" + model, source="test")
    spec = parse_spec("store: {usage_retention_days: 32}\n" + model, source="test")
    assert spec.store.usage_retention_days == 32


def test_expired_responses_are_swept_in_small_transactions(tmp_path: Path) -> None:
    """Every expired response goes in one sweep, however many, a few at a time (rows of megabytes each in
    one transaction held SQLite's write lock for seconds); the unexpired stay."""
    engine = open_database(f"sqlite:///{tmp_path / 'store.db'}")
    store = ResponseStore(engine, ttl_s=3600)
    with Session(engine) as session, session.begin():
        for n in range(130):
            expires = time.time() + (3600 if n % 10 == 0 else -1)
            session.add(
                ResponseRow(
                    id=f"r{n}",
                    tenant="acme",
                    model="m",
                    created_at=time.time(),
                    expires_at=expires,
                    input_items="[]",
                    response="{}",
                )
            )
    transactions = []
    event.listen(engine, "commit", lambda connection: transactions.append(1))
    assert store.sweep_expired(batch=50) == 117
    assert len(transactions) == 3  # 50, 50 and 17
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(ResponseRow)) == 13
    engine.dispose()
