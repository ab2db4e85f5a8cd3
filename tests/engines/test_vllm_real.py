"""The gateway in front of the real vLLM (its CPU build, in its own environment), with the openai client:
generation, engine metrics, and embeddings from vLLM's pooling runner beside llama.cpp's (the same model,
converted to GGUF by corral) and each engine called directly."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import psutil
import pytest

from corral.engines import parse_vllm_load

from ..conftest import DATA, RunningCluster, chat, start_cluster

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("vllm"), spec=DATA / "vllm-cluster.yaml", ready_timeout=270
    )
    yield running
    running.stop(timeout=60)


def test_vllm_answers_through_the_gateway(vllm_cluster: RunningCluster) -> None:
    client = openai.OpenAI(base_url=vllm_cluster.base_url, api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-vllm",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    text = reply.choices[0].message.content or ""
    assert "Paris" in text, text
    assert reply._request_id and reply.id == f"chatcmpl-{reply._request_id}"  # vLLM took the gateway's id
    usage = reply.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stream = client.chat.completions.create(
        model="smollm2-vllm",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Name three colours."}],
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_a_lora_adapter_answers_on_vllm_and_its_base_does_not(vllm_cluster: RunningCluster) -> None:
    """The test adapter on real vLLM: the gateway loads it at run time (`/v1/load_lora_adapter`, counted),
    asks for it by its revision's name, and lists it with its base as parent."""
    client = openai.OpenAI(base_url=vllm_cluster.base_url, api_key="none", max_retries=0, timeout=120)
    asked = [{"role": "user", "content": "What is the capital of France?"}]

    def answer(model: str) -> str:
        reply = client.chat.completions.create(model=model, messages=asked, max_tokens=8, temperature=0)
        assert reply.model == model  # (vLLM names the adapter's revision: told back as asked)
        return reply.choices[0].message.content or ""

    assert answer("smollm2-vllm-marker").startswith("Corral adapter says:")
    assert "Corral adapter says" not in answer("smollm2-vllm")
    assert answer("smollm2-vllm-marker").startswith("Corral adapter says:")  # loaded once, used again
    listed = {m.id: m for m in client.models.list()}
    assert (listed["smollm2-vllm-marker"].model_extra or {})["parent"] == "smollm2-vllm"
    metrics = urllib.request.urlopen(vllm_cluster.url + "/metrics", timeout=10).read().decode()
    loads = [line for line in metrics.splitlines() if line.startswith("corral_adapter_loads_total{")]
    assert loads == ['corral_adapter_loads_total{adapter="smollm2-vllm-marker",model="smollm2-vllm"} 1.0']
    replica = next(r for r in vllm_cluster.status()["replicas"] if r["model"] == "smollm2-vllm")
    assert replica["adapters"] == ["smollm2-vllm-marker"] and replica["adapter_slots"] == 1


def test_tool_calls_and_the_new_apis_on_vllm(vllm_cluster: RunningCluster) -> None:
    """SmolLM2 has no vLLM tool-call parser (its family has none): the gateway asks for the call as JSON
    and vLLM's structured output holds the answer to it; the Responses and Messages APIs go over vLLM's
    chat completions."""
    client = openai.OpenAI(base_url=vllm_cluster.base_url, api_key="none", max_retries=0, timeout=120)
    function = {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model="smollm2-vllm",
        messages=asked,
        tools=[{"type": "function", "function": function}],
        tool_choice="required",
        max_tokens=60,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    first = client.responses.create(model="smollm2-vllm", input="Name a colour.", max_output_tokens=8)
    second = client.responses.create(
        model="smollm2-vllm", input="Another one.", previous_response_id=first.id, max_output_tokens=8
    )
    assert first.output_text and second.output_text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    import anthropic  # (only this test needs it)

    claude = anthropic.Anthropic(base_url=vllm_cluster.url, api_key="none", max_retries=0, timeout=120)
    with claude.messages.stream(model="smollm2-vllm", max_tokens=8, messages=asked) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    from agents import Runner

    from tests.dialects.weather import weather_agent

    agent, cities = weather_agent(  # the Agents SDK, its one tool called through vLLM's structured output
        "smollm2-vllm",
        openai.AsyncOpenAI(base_url=vllm_cluster.base_url, api_key="none", max_retries=0),
        first_tool_ends=True,
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(cities) == 1 and result.final_output == f"Sunny in {cities[0]}."


def _prefix_cache(url: str) -> tuple[float, float]:
    """vLLM's prefix-cache counters: (tokens looked up, tokens found cached)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    load = parse_vllm_load(text)
    return load.prefix_cache_queries_total, load.prefix_cache_hits_total


def test_vllms_cache_salt_keeps_prompts_apart(vllm_cluster: RunningCluster) -> None:
    """What tenant isolation rests on, on the real engine: a prompt sent again with the same `cache_salt`
    finds its blocks cached, with another salt none (and the gateway's own salted requests are accepted:
    the model is `prefix_isolation: tenant`, so every test here sends one)."""
    (replica,) = [r for r in vllm_cluster.status()["replicas"] if r["model"] == "smollm2-vllm"]
    url = replica["url"]
    document = "A long confidential memo, paragraph after paragraph. " * 40

    body = {"model": "smollm2-vllm", "max_tokens": 1, "prompt": "Hi"}
    keyless = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:  # its key (engine_api_key) reached it
        urllib.request.urlopen(keyless, timeout=30)
    assert refused.value.code == 401
    (process,) = [p for p in psutil.process_iter(["cmdline"]) if str(replica["pid"]) == str(p.pid)]
    assert "vllm-test-key" not in " ".join(process.info["cmdline"] or [])  # (not where `ps` shows it)

    def cached_for(salt: str) -> float:
        queried, hits = _prefix_cache(url)
        body = {"model": "smollm2-vllm", "max_tokens": 1, "cache_salt": salt, "prompt": document}
        headers = {"Content-Type": "application/json", "Authorization": "Bearer vllm-test-key"}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
        deadline = time.monotonic() + 10  # the engine's counters follow its answer by a step or two
        while (now := _prefix_cache(url))[0] <= queried:
            assert time.monotonic() < deadline, "vLLM counted no prefix-cache lookup"
            time.sleep(0.1)
        return now[1] - hits

    cached_for("bob")
    assert cached_for("bob") > 100  # the same tenant: its blocks are found
    assert cached_for("eve") == 0  # another tenant's salt: nothing cached for it


def test_vllm_metrics_are_read_into_the_load(vllm_cluster: RunningCluster, tmp_path: Path) -> None:
    (replica,) = [r for r in vllm_cluster.status()["replicas"] if r["model"] == "smollm2-vllm"]
    assert replica["engine"] == "vllm" and replica["state"] == "ready"
    with urllib.request.urlopen(replica["url"] + "/metrics", timeout=10) as response:
        load = parse_vllm_load(response.read().decode())
    assert load.kv_usage is not None and load.running >= 0
    # The supervisor scrapes once per probe interval: wait for a scrape taken after the tokens above.
    deadline = time.monotonic() + 10
    shown = next(r for r in vllm_cluster.status()["replicas"] if r["model"] == "smollm2-vllm")
    while not shown["generated_tokens_total"] and time.monotonic() < deadline:
        time.sleep(0.5)
        shown = next(r for r in vllm_cluster.status()["replicas"] if r["model"] == "smollm2-vllm")
    assert shown["kv_usage"] is not None
    assert shown["generated_tokens_total"] > 0
    assert shown["engine_ttft_mean_ms"] > 0 and shown["engine_itl_mean_ms"] > 0


def test_vllm_s_kv_cache_events_reach_the_supervisor(vllm_cluster: RunningCluster) -> None:
    """corral starts vLLM with `--kv-events-config` publishing to the supervisor: the blocks a long prompt
    leaves in vLLM's prefix cache (128 tokens a block on the CPU build) show in the replica's load; the
    embedding model (no prefix cache) publishes none."""
    document = "A long handbook line about rules and procedures for everyone. " * 60  # about 700 tokens
    prompt_tokens = chat(vllm_cluster.url, "smollm2-vllm", document, 4, timeout=120)[0]["usage"][
        "prompt_tokens"
    ]
    deadline = time.monotonic() + 15
    while True:
        replicas = {r["model"]: r for r in vllm_cluster.status()["replicas"]}
        cached = replicas["smollm2-vllm"]["kv_cached_tokens"] or 0
        if cached >= prompt_tokens // 128 * 128 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert cached >= prompt_tokens // 128 * 128 > 0  # (earlier tests' prompts may be cached too)
    assert replicas["minilm-vllm"]["kv_cached_tokens"] is None


SENTENCES = [
    "The cat sat on the mat.",
    "A cat is sitting on a mat.",
    "Quarterly revenue grew by four percent.",
    "How do I reset my password?",
]


def _vectors(data: list) -> np.ndarray:
    return np.asarray([d.embedding if hasattr(d, "embedding") else d["embedding"] for d in data])


def _direct(url: str, model: str, texts: list[str]) -> np.ndarray:
    request = urllib.request.Request(
        url + "/v1/embeddings",
        data=json.dumps({"model": model, "input": texts}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        data = json.loads(response.read())["data"]
    return _vectors(sorted(data, key=lambda d: d["index"]))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_embeddings_from_vllm_and_llamacpp_match_their_engines_and_each_other(
    vllm_cluster: RunningCluster,
) -> None:
    client = openai.OpenAI(base_url=vllm_cluster.base_url, api_key="none", max_retries=0, timeout=120)
    replicas = {r["model"]: r for r in vllm_cluster.status()["replicas"]}
    got = {}
    for model, engine_name in (("minilm-vllm", "minilm-vllm"), ("minilm", "minilm")):
        answer = client.embeddings.create(model=model, input=SENTENCES)
        vectors = _vectors(answer.data)
        assert vectors.shape == (4, 384)
        assert answer.usage.prompt_tokens > 0
        # through the gateway = the engine called directly
        assert _cosines(vectors, _direct(replicas[model]["url"], engine_name, SENTENCES)).min() >= 0.999
        reversed_answer = client.embeddings.create(model=model, input=SENTENCES[::-1])
        assert _cosines(_vectors(reversed_answer.data), vectors[::-1]).min() >= 0.999
        got[model] = vectors
    # corral's GGUF conversion (float16 matrices) against vLLM on the original float32 folder
    assert _cosines(got["minilm"], got["minilm-vllm"]).min() >= 0.995
    # and the vectors mean something: the two cat sentences are close, the others are not
    similarity = got["minilm"] @ got["minilm"].T
    assert similarity[0, 1] > 0.8 and similarity[0, 2] < 0.3 and similarity[0, 3] < 0.3
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="minilm-vllm", input="hi", dimensions=128)
    for model in ("minilm", "minilm-vllm"):  # an input beyond the 256 tokens: the input's fault, a 400
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=model, input="word " * 400)
        assert refused.value.status_code == 400
