"""A batch of a key a tenant-admin made runs within its maker's budget too: its lines ran as the key alone,
so a tenant-admin's keys could each spend its whole monthly budget through batches (its month caught up only
once their usage rows were written). A real runner and store; the lines' answers are recorded."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import orjson

from corral.admission import Principal
from corral.batch import BatchRunner, BatchStore, NewBatch
from corral.config import BatchSettings
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import KeyStore, open_database
from tests.batch.running import running, until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Recorded:
    """Answers every line at once, keeping who it ran as."""

    def __init__(self) -> None:
        self.principals: list[Principal] = []

    async def run_line(
        self, principal: Principal, path: str, body: bytes, request_id: str | None = None
    ) -> tuple[int, bytes]:
        self.principals.append(principal)
        return 200, orjson.dumps({"object": "chat.completion", "choices": []})


async def test_a_batch_of_a_made_key_runs_under_its_makers_budget(tmp_path: Path) -> None:
    database = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    keys, store = KeyStore(database), BatchStore(database)
    _, maker = keys.create("acme", role="tenant-admin", monthly_token_budget=1_000)
    _, made = keys.create("acme", monthly_token_budget=1_000, parent=maker.id)
    replicas = ReplicaSet()
    replicas.add(Replica(id="m-0", model="m", engine="sim", state=ReplicaState.READY, capacity=4))
    answers = Recorded()
    settings = BatchSettings(poll_s=0.02, headroom=0, max_share=1.0)
    runner = BatchRunner(store, answers, keys, replicas, lambda: {}, settings)
    for key in (made, maker):
        asked = NewBatch("acme", key.id, "/v1/chat/completions", "file-x", timedelta(hours=1))
        batch = store.create_batch(asked)
        assert store.start(batch.id, "m", [("c0", orjson.dumps(BODY))])
    async with running(runner):
        await until(lambda: len(answers.principals) == 2)
    lines = {principal.key_id: principal for principal in answers.principals}
    assert [(p.key_id, p.monthly_token_budget) for p in lines[made.id].parents] == [(maker.id, 1_000)]
    # the maker's own lines read its month as its keys' too (as a user's they read its own use alone)
    assert lines[maker.id].role == "tenant-admin" and lines[maker.id].parents == ()
