"""A failing cache shows in /metrics, not only as a falling hit rate: a dead Redis (a closed port) counts
its failed store calls by operation, and a semantic cache whose embedding replica is down counts the
questions left without a vector by reason. Gateways in front of simulated replicas, with the openai
client; /metrics read as Prometheus scrapes it."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from corral.config import CacheSettings, ModelCacheSpec
from corral.routing import ReplicaState

from .test_exact import ADMIN, HI, Gateway, ask, client, engine, gateway, key_for
from .test_semantic import engines
from .test_semantic import gateway as semantic_gateway

__all__ = ["engine", "engines"]  # (the fixtures, used by name)


async def _counts(gw: Gateway, family: str) -> dict[str, float]:
    """The family's samples by their one label's value."""
    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with session.get(gw.url + "/metrics", headers=headers) as response:
            text = await response.text()
    found = {}
    for metrics in text_string_to_metric_families(text):
        for sample in metrics.samples:
            if sample.name == f"{family}_total":
                found[next(iter(sample.labels.values()))] = sample.value
    return found


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_dead_redis_cache_counts_its_failed_calls(engine: str, tmp_path: Path) -> None:
    dead = CacheSettings(
        backend="redis", redis_url=f"redis://127.0.0.1:{_closed_port()}/0", redis_timeout=0.2
    )
    gw = await gateway(engine, tmp_path, dead)
    try:
        assert await _counts(gw, "corral_cache_store_errors") == {
            "get": 0,
            "put": 0,
            "scan": 0,
            "present": 0,
            "purge": 0,
        }
        content, state, _ = await ask(client(gw, await key_for(gw, "d")), HI, stream=False)
        assert content and state == "miss"
        await gw.services.cache.flush()  # type: ignore[union-attr]
        counts = await _counts(gw, "corral_cache_store_errors")
        assert counts["get"] == 1  # (then Redis is left alone a while: the answer's put is not tried)
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {ADMIN}"}
            async with session.delete(gw.url + "/admin/cache?tenant=d", headers=headers) as response:
                assert response.status == 503
        assert (await _counts(gw, "corral_cache_store_errors"))["purge"] == 1
    finally:
        await gw.server.stop()


async def test_an_embedder_that_is_down_counts_the_questions_it_left_without_a_vector(
    engines: list[str], tmp_path: Path
) -> None:
    gw = await semantic_gateway(engines, tmp_path, ModelCacheSpec(semantic=True, embedding_model="e"))
    try:
        for replica in gw.replicas.of("e"):  # type: ignore[attr-defined]
            replica.state = ReplicaState.FAILED
        c = client(gw, await key_for(gw, "acme"))
        for question in ("What is the capital of France?", "And of Spain?"):
            content, state, _ = await ask(c, [{"role": "user", "content": question}], stream=False)
            assert content and state == "miss"
        counts = await _counts(gw, "corral_cache_embed_errors")
        assert counts == {"timeout": 0, "paused": 0, "busy": 0, "error": 2}
    finally:
        await gw.server.stop()
