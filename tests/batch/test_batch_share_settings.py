"""The batch runner's share of a model's slots follows the spec's `batch.max_share` and
`batch.reserve_window_s`: lines never take more than `max_share` of the ready replicas' slots, and the
most slots interactive requests held at once stay reserved for exactly `reserve_window_s` after the burst
(the runner's own spare-slot count, on a replica set as the supervisor publishes it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from corral.batch import BatchRunner, BatchStore
from corral.config import parse_spec
from corral.routing import Replica, ReplicaSet, ReplicaState
from corral.store import KeyStore, open_database

SPEC = """
auth: {{open: true}}
batch: {{headroom: 0, max_share: {max_share}, reserve_window_s: {window}}}
models:
  - name: m
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, gpu: l4, replicas: 2, max_num_seqs: 4}}
"""


def runner(tmp_path: Path, max_share: float, window: float) -> tuple[BatchRunner, list[Replica]]:
    """A runner configured by a spec, over two ready replicas of 4 slots each (8 in all)."""
    spec = parse_spec(SPEC.format(max_share=max_share, window=window), source="test")
    replicas = ReplicaSet()
    ready = [
        Replica(id=f"m-{i}", model="m", engine="sim", state=ReplicaState.READY, capacity=4) for i in range(2)
    ]
    for replica in ready:
        replicas.add(replica)
    engine = open_database(f"sqlite:///{tmp_path / 'batch.db'}")
    no_executor: Any = None  # spare() runs no line
    nothing_queued: dict[str, int] = {}
    made = BatchRunner(
        BatchStore(engine), no_executor, KeyStore(engine), replicas, lambda: nothing_queued, spec.batch
    )
    return made, ready


def test_batch_lines_take_at_most_max_share_of_the_slots(tmp_path: Path) -> None:
    half, _ = runner(tmp_path, max_share=0.5, window=0)
    assert half.spare("m") == 4  # 8 idle slots, half of them for batch lines
    whole, _ = runner(tmp_path, max_share=1.0, window=0)
    assert whole.spare("m") == 8
    quarter, _ = runner(tmp_path, max_share=0.25, window=0)
    assert quarter.spare("m") == 2


def test_an_interactive_burst_keeps_its_slots_free_for_reserve_window_s(tmp_path: Path) -> None:
    window = 0.5
    batch, replicas = runner(tmp_path, max_share=1.0, window=window)
    replicas[0].outstanding, replicas[1].outstanding = 3, 3  # a burst: 6 of 8 slots busy
    burst_seen = time.monotonic()
    assert batch.spare("m") == 2
    replicas[0].outstanding = replicas[1].outstanding = 0  # the burst is over
    assert batch.spare("m") == 2  # its 6 slots stay reserved: a burst like it finds room at once
    deadline = burst_seen + 10
    while batch.spare("m") != 8:
        assert time.monotonic() < deadline, "the burst's slots were never given back to batch lines"
        time.sleep(0.02)
    assert time.monotonic() - burst_seen >= window  # given back only once the window has passed

    forgetful, replicas = runner(tmp_path, max_share=1.0, window=0)
    replicas[0].outstanding = 6
    assert forgetful.spare("m") == 2
    replicas[0].outstanding = 0
    assert forgetful.spare("m") == 8  # no window: nothing of the burst is remembered
