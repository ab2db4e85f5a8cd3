"""What an operator reads of keys, usage and the audit trail: a key's budget use in `keys list/show`,
`keys show` taking the prefix `keys list` shows, `corral usage --by key` naming tenant and key name, 429s
counted as refusals rather than errors, and a date range; `corral audit` and its filters."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from typer.testing import CliRunner

from corral.cli import app
from corral.store import AuditEntry, AuditLog, UsageRecord, UsageStore, open_database
from corral.store.keys import new_secret


def run(*args: str, columns: int = 160) -> tuple[int, str]:
    done = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    return done.exit_code, done.output


def test_no_secret_begins_with_a_dash_the_shown_prefix_would_be_taken_for_an_option(tmp_path: Path) -> None:
    """`keys list` shows a secret's first six characters after `sk-corral-`; one in 64 began with "-",
    and `corral keys show -M_hs_…` was then a usage error (the test below failed so once in CI)."""
    drawn = [new_secret() for _ in range(3000)]
    assert all(s.startswith("sk-corral-") and len(s) == 53 for s in drawn)
    assert not any(s.startswith("sk-corral--") for s in drawn)
    store = f"sqlite:///{tmp_path / 'c.db'}"
    assert run("keys", "create", "--tenant", "acme", "--store", store)[0] == 0
    code, out = run("keys", "show", "--store", store, "--", "-M_hs_…")  # an older key's, after `--`
    assert code == 1 and "no key with id -M_hs_…" in out, out


def test_budget_use_prefixes_names_refusals_and_dates(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'c.db'}"
    code, out = run(
        "keys",
        "create",
        "--tenant",
        "acme",
        "--name",
        "ci-bot",
        "--monthly-tokens",
        "1000",
        "--store",
        store,
        "--json",
    )
    assert code == 0, out
    made = json.loads(out[out.index("{") :])
    now = datetime.now(UTC)
    UsageStore(open_database(store)).write(
        [
            UsageRecord(now, made["id"], "acme", "m", 100, 150, 5.0, 90.0, 200, "r0"),
            UsageRecord(now, made["id"], "acme", "m", 0, 0, None, 1.0, 429, None),
            UsageRecord(now, made["id"], "acme", "m", 10, 0, None, 3.0, 502, "r0"),
        ]
    )
    code, out = run("keys", "list", "--store", store)
    assert code == 0 and "260/1k" in out, out  # used this month / budget
    shown_prefix = made["prefix"].removeprefix("sk-corral-") + "…"  # as `keys list` shows it
    for ref in (made["id"], made["id"][:6], shown_prefix, made["prefix"]):
        code, out = run("keys", "show", ref, "--store", store)
        assert code == 0 and made["id"] in out and "260 tokens (26% of monthly_token_budget)" in out, (
            ref,
            out,
        )
    code, out = run("keys", "show", "zzzzzz", "--store", store)
    assert code == 1 and "no key with id zzzzzz" in out
    code, out = run("usage", "--by", "key", "--store", store, "--json")
    (row,) = json.loads(out)
    assert (row["key"], row["tenant"], row["name"]) == (made["id"], "acme", "ci-bot")
    assert (row["requests"], row["refused"], row["errors"]) == (3, 1, 1)  # the 429 is a refusal
    code, out = run("usage", "--by", "key", "--store", store)
    assert code == 0 and made["id"] in out and "ci-bot" in out and "refused" in out, out
    code, out = run("usage", "--by", "key", "--store", store, columns=80)
    assert code == 0 and "…" not in out and made["id"][:7] in out, out  # folded at 80 columns, never cut
    code, out = run("keys", "create", "--tenant", "other", "--store", store)
    code, out = run("keys", "list", "--tenant", "acme", "--store", store)
    assert code == 0 and "acme" in out and "other" not in out, out
    tomorrow = (now + timedelta(days=1)).strftime("%Y-%m-%d")
    code, out = run("usage", "--store", store, "--since", tomorrow, "--json")
    assert code == 0 and json.loads(out) == []
    code, out = run("usage", "--store", store, "--until", tomorrow, "--json")
    assert code == 0 and len(json.loads(out)) == 1


def test_the_audit_trail_filtered_by_action_actor_tenant_time_and_request(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'c.db'}"
    for tenant in ("acme", "globex"):
        assert run("keys", "create", "--tenant", tenant, "--store", store)[0] == 0
    told = "req_0123456789abcdef01234567"
    AuditLog(open_database(store)).record(
        AuditEntry("oidc:ann", "operator", "spec.apply", 200, "acme", "10.0.0.7", None, None, told)
    )
    code, out = run("audit", "--store", store, "--json")
    rows = json.loads(out)
    assert [r["action"] for r in rows] == ["spec.apply", "key.create", "key.create"]  # latest first
    assert rows[1]["actor"].startswith("cli:") and rows[1]["detail"]["tenant"] == "globex"
    for flags, actions in (
        (("--action", "key.*"), ["key.create", "key.create"]),
        (("--action", "key"), []),  # a prefix only with its star
        (("--actor", "oidc:ann"), ["spec.apply"]),
        (("--tenant", "acme"), ["spec.apply"]),  # the actor's tenant
        (("--request-id", told), ["spec.apply"]),
        (("--limit", "1"), ["spec.apply"]),
        (("--since", (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%d")), []),
    ):
        code, out = run("audit", *flags, "--store", store, "--json")
        assert code == 0 and [r["action"] for r in json.loads(out)] == actions, flags
    code, out = run("audit", "--store", store)
    assert code == 0 and "10.0.0.7" in out and told in out and "spec.apply" in out, out
    code, out = run("audit", "--store", store, columns=80)
    assert code == 0 and "…" not in out and "spec.apply" in out, out  # folded at 80 columns, never cut
