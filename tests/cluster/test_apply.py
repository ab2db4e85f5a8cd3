"""`corral apply` on a live cluster under load (supervised simulated replicas): a model added and a replica
count raised, then the model removed and the count lowered, with 0 failed requests; changes apply cannot
make live are refused with the reason and change nothing."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

from corral.cluster.changes import plan_changes
from corral.cluster.counts import scale_down_victims
from corral.config import parse_spec
from tests.conftest import CORRAL, RunningCluster, get_json, start_cluster

BASE = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
gateway: {{read_timeout: {read_timeout}}}
models:
  - name: alpha
    arch: llama-3.1-8b
    routing: round_robin
    deployments: [{{engine: sim, replicas: {alpha}, gpu: h100-sxm, time_scale: {time_scale}}}]
"""
BETA = """
  - name: beta
    arch: llama-3.1-8b
    routing: least_outstanding_requests
    deployments: [{engine: sim, replicas: 1, gpu: l4, time_scale: 20}]
"""


def spec(tmp: Path, name: str, alpha: int, beta: bool, time_scale: int = 20, read_timeout: int = 120) -> Path:
    path = tmp / name
    text = BASE.format(alpha=alpha, time_scale=time_scale, read_timeout=read_timeout) + (BETA if beta else "")
    path.write_text(text)
    return path


def apply(cluster: RunningCluster, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CORRAL, "apply", "-f", str(path), "--url", cluster.url, "--grace", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def wait_for(condition: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def replicas(cluster: RunningCluster) -> dict[str, str]:
    return {r["id"]: r["state"] for r in cluster.status()["replicas"]}


def gpus(cluster: RunningCluster) -> dict[str, str | None]:
    """The GPUs each replica holds (a simulated replica takes them as vLLM's would)."""
    return {r["id"]: r["gpus"] for r in cluster.status()["replicas"]}


def models(cluster: RunningCluster) -> set[str]:
    return {m["id"] for m in get_json(cluster.base_url + "/models")[1]["data"]}


def test_plan_changes_tells_live_settings_from_rollouts() -> None:
    running = parse_spec(BASE.format(alpha=2, time_scale=20, read_timeout=120), source="a")
    same = running.model_copy()
    assert plan_changes(running, same) == []
    text = BASE.format(alpha=2, time_scale=20, read_timeout=120)
    policy = parse_spec(text.replace("round_robin", "power_of_two"), source="b")
    assert [c.action for c in plan_changes(running, policy)] == ["settings"]
    weights = parse_spec(BASE.format(alpha=3, time_scale=10, read_timeout=120), source="c")
    assert [c.action for c in plan_changes(running, weights)] == ["rollout"]  # not also a scale_up
    scaled = parse_spec(
        text.replace("time_scale: 20}", "time_scale: 20, autoscale: {min_replicas: 1, max_replicas: 4}}"),
        source="d",
    )
    assert [c.action for c in plan_changes(running, scaled)] == ["settings"]


def test_a_lower_count_drains_the_replicas_that_serve_nothing_first() -> None:
    """The newest replicas go, except that one serving nothing (its engine given up on after failed
    starts, unhealthy, starting) goes before a ready one: lowering 2 to 1 beside a replica that failed
    must not drain the only one that answers."""
    from corral.routing import Replica, ReplicaState

    def fleet(*states: ReplicaState) -> list[Replica]:
        return [Replica(id=f"a-{i}", model="a", engine="sim", state=s) for i, s in enumerate(states)]

    ready, failed, unhealthy = ReplicaState.READY, ReplicaState.FAILED, ReplicaState.UNHEALTHY
    assert scale_down_victims(fleet(ready, ready, ready), 2) == ["a-2", "a-1"]
    assert scale_down_victims(fleet(failed, ready), 1) == ["a-0"]
    assert scale_down_victims(fleet(ready, unhealthy, ready, failed), 3) == ["a-3", "a-1", "a-2"]


@pytest.mark.slow
def test_apply_adds_removes_and_scales_without_failing_a_request(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, spec(tmp_path, "start.yaml", alpha=2, beta=False))
    stop, failures, served = threading.Event(), [], [0]

    def user(stream: bool) -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
        while not stop.is_set():
            try:
                answer = client.chat.completions.create(
                    model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=stream
                )
                if stream:
                    assert any(c.choices and c.choices[0].finish_reason for c in answer)
                served[0] += 1
            except (openai.APIError, AssertionError) as exc:
                failures.append(repr(exc))

    users = [threading.Thread(target=user, args=(stream,)) for stream in (True, True, False, False)]
    try:
        for thread in users:
            thread.start()
        grown = apply(cluster, spec(tmp_path, "grow.yaml", alpha=3, beta=True))
        assert grown.returncode == 0, grown.stderr
        assert "add_model: beta" in grown.stderr
        assert "scale_up: alpha (deployment 0: 1 replica added, 3 now)" in grown.stderr
        want = {"alpha-0": "ready", "alpha-1": "ready", "alpha-2": "ready", "beta-0": "ready"}
        wait_for(lambda: replicas(cluster) == want, "the new replicas became ready")
        assert gpus(cluster) == {"alpha-0": "0", "alpha-1": "1", "alpha-2": "2", "beta-0": "0"}
        assert models(cluster) == {"alpha", "beta"}
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none")
        answer = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content
        routing = get_json(cluster.url + "/admin/routing")[1]
        assert routing["policies"]["beta"] == "least_outstanding_requests"

        shrunk = apply(cluster, spec(tmp_path, "shrink.yaml", alpha=1, beta=False))
        assert shrunk.returncode == 0, shrunk.stderr
        assert "remove_model: beta" in shrunk.stderr
        assert "scale_down: alpha (deployment 0: 2 replicas drained, 1 left)" in shrunk.stderr
        assert replicas(cluster) == {"alpha-0": "ready"}  # the newest were drained, the oldest kept
        assert models(cluster) == {"alpha"}
        regrown = apply(cluster, spec(tmp_path, "regrow.yaml", alpha=2, beta=False))
        assert regrown.returncode == 0, regrown.stderr
        wait_for(lambda: replicas(cluster) == {"alpha-0": "ready", "alpha-3": "ready"}, "alpha-3 ready")
        assert gpus(cluster) == {"alpha-0": "0", "alpha-3": "1"}  # a free GPU, not alpha-0's again
        assert apply(cluster, spec(tmp_path, "shrink.yaml", alpha=1, beta=False)).returncode == 0
        assert replicas(cluster) == {"alpha-0": "ready"}

        again = apply(cluster, spec(tmp_path, "same.yaml", alpha=1, beta=False))
        assert again.returncode == 0 and "nothing to change" in again.stderr
        policy = spec(tmp_path, "policy.yaml", alpha=1, beta=False)
        policy.write_text(policy.read_text().replace("routing: round_robin", "routing: power_of_two"))
        changed = apply(cluster, policy)
        assert changed.returncode == 0 and "settings: alpha (routing)" in changed.stderr, changed.stderr
        assert get_json(cluster.url + "/admin/routing")[1]["policies"]["alpha"] == "power_of_two"
        assert replicas(cluster) == {"alpha-0": "ready"}  # a live setting: no replica changed
        refused = apply(cluster, spec(tmp_path, "gateway.yaml", alpha=1, beta=False, read_timeout=60))
        assert refused.returncode == 1, refused.stderr
        assert "changing gateway.read_timeout needs a restart" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert replicas(cluster) == {"alpha-0": "ready"}
        time.sleep(1)
    finally:
        stop.set()
        for thread in users:
            thread.join(timeout=60)
        cluster.stop()
    assert failures == []
    assert served[0] > 20


LIVE = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
queue: {{max_queued: {queued}, timeout: 60}}
gateway: {{routing: {routing}}}
models:
  - name: alpha
    arch: llama-3.1-8b
    deployments: [{{engine: sim, replicas: 1, gpu: l4, time_scale: 2, max_num_seqs: 1}}]
"""


def burst(cluster: RunningCluster, count: int) -> list[str]:
    """`count` requests at once to a replica with one slot: what each ended as."""
    outcomes: list[str] = []

    def one() -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=120)
        try:
            client.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=48
            )
            outcomes.append("ok")
        except openai.APIStatusError as exc:
            outcomes.append(f"{exc.status_code} {exc.body.get('code') if isinstance(exc.body, dict) else ''}")

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return sorted(outcomes)


@pytest.mark.slow
def test_queue_bounds_and_the_default_routing_policy_change_live(tmp_path: Path) -> None:
    start = tmp_path / "live.yaml"
    start.write_text(LIVE.format(queued=64, routing="least_outstanding_requests"))
    cluster = start_cluster(tmp_path, start)
    try:
        assert burst(cluster, 3) == ["ok", "ok", "ok"]  # two wait in the queue for the one slot
        changed = tmp_path / "changed.yaml"
        changed.write_text(LIVE.format(queued=0, routing="round_robin"))
        applied = apply(cluster, changed)
        assert applied.returncode == 0 and "cluster_settings: queue,gateway" in applied.stderr, applied.stderr
        assert get_json(cluster.url + "/admin/routing")[1]["policies"]["alpha"] == "round_robin"
        assert burst(cluster, 3) == ["503 queue_full", "503 queue_full", "ok"]  # no queue any more
        assert replicas(cluster) == {"alpha-0": "ready"}
    finally:
        cluster.stop()


@pytest.mark.slow
async def test_an_apply_whose_caller_goes_away_is_made_whole(tmp_path: Path) -> None:
    """Ctrl-C, or a proxy's timeout while replicas drain, ends `corral apply`'s request, not the apply:
    cut short, beta's replicas would run with no spec naming them (the next apply would start beta
    again beside them, and a spec without beta could never remove it). Gone while it still prepares, it
    changes nothing."""
    import asyncio

    from corral.cluster import LocalProcessRuntime, Supervisor
    from corral.cluster.reconcile import Reconciler
    from corral.config import Paths, SupervisorSettings
    from corral.engines import SimEngineAdapter, launch_plans
    from corral.routing import ReplicaSet

    first, second = (
        parse_spec(spec(tmp_path, name, alpha=alpha, beta=beta).read_text(), source="test")
        for name, alpha, beta in (("a.yaml", 2, False), ("b.yaml", 1, True))
    )
    engine = SimEngineAdapter()
    slow = {"beta"}  # the models whose preparing takes a second (a long fetch)

    def prepare(model, deployment):  # type: ignore[no-untyped-def]
        if model.name in slow:
            time.sleep(1.0)
        return engine, launch_plans(engine, model, deployment, Paths.from_env(), lambda *_: None)

    settings = SupervisorSettings(probe_interval=0.3, probe_timeout=0.5)
    supervisor = Supervisor(ReplicaSet(), LocalProcessRuntime(tmp_path / "logs"), settings)
    supervisor.add("alpha", engine, prepare(first.models[0], first.models[0].deployments[0])[1])

    async def told(model: object) -> None:
        return None

    reconciler = Reconciler(supervisor, first, prepare, told)
    await supervisor.start()
    try:
        # gone while it prepares (Ctrl-C during a long fetch): nothing changes
        preparing = asyncio.create_task(reconciler.apply(second, grace_s=5.0))
        await asyncio.sleep(0.3)
        preparing.cancel()
        await asyncio.sleep(1.2)
        assert [m.name for m in reconciler.spec.models] == ["alpha"] and not reconciler._lock.locked()
        assert not supervisor.replica_ids("beta") and len(supervisor.replica_ids("alpha")) == 2
        slow.clear()
        applying = asyncio.create_task(reconciler.apply(second, grace_s=5.0))
        while not supervisor.replica_ids("beta"):  # noqa: ASYNC110 (beta started; alpha's second drains next)
            await asyncio.sleep(0.05)
        applying.cancel()
        for _ in range(300):
            if not reconciler._lock.locked():
                break
            await asyncio.sleep(0.1)
        assert [m.name for m in reconciler.spec.models] == ["alpha", "beta"]
        assert len(supervisor.replica_ids("alpha")) == 1
        assert await reconciler.apply(second, grace_s=5.0) == []  # nothing left to do
        # the gateway stopping while an apply prepares: the apply ends, nothing changed, the lock free
        slow.add("alpha")
        preparing = asyncio.create_task(reconciler.apply(first, grace_s=5.0))
        await asyncio.sleep(0.3)
        began = time.monotonic()
        await reconciler.stop()
        assert time.monotonic() - began < 0.5 and preparing.cancelled()
        assert supervisor.replica_ids("beta") and not reconciler._lock.locked()
    finally:
        await reconciler.stop()
        await supervisor.stop()


async def test_a_models_settings_are_read_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Telling the gateway a changed model's settings reads its adapters' sources (a hub may be asked) in
    a thread: requests on the event loop go on meanwhile."""
    import asyncio

    from corral.cli import up

    def slow_settings(model: object, paths: object) -> dict[str, object]:
        time.sleep(0.5)  # (a hub slow to answer)
        return {"name": "alpha"}

    told: list[dict[str, object]] = []
    monkeypatch.setattr(up, "model_settings", slow_settings)
    loop, lags = asyncio.get_running_loop(), []

    async def ticker() -> None:
        while True:
            before = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - before - 0.01)

    ticking = asyncio.create_task(ticker())
    await up._tell(told.append, None, object())  # type: ignore[arg-type]
    ticking.cancel()
    # (read on the loop, one tick would wait the whole 0.5 s; a busy machine's ticks wait up to ~0.2 s)
    assert told == [{"name": "alpha"}] and len(lags) > 20 and max(lags) < 0.4
