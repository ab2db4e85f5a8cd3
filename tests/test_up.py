"""`corral up` end to end: real llama-server replicas behind the gateway, driven by the official client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request

import openai
import pytest

from .conftest import CORRAL, RunningCluster, get_json

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=60)


def test_chat_completion_has_text_and_consistent_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24)
    assert reply.choices[0].message.content and reply.choices[0].message.content.strip()
    usage = reply.usage
    assert usage is not None
    assert usage.prompt_tokens > 5 and 1 <= usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_whole_answer_leaves_out_llamacpps_timings_unless_asked(cluster: RunningCluster) -> None:
    """llama-server adds `timings` (its own extension) to every whole answer; OpenAI's answers have none."""
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 4}
    for extra, kept in (({}, False), ({"timings_per_token": True}, True)):
        request = urllib.request.Request(
            cluster.url + "/v1/chat/completions",
            data=json.dumps({**body, **extra}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            data = json.load(answer)
        assert ("timings" in data) is kept, data
        assert data["usage"]["completion_tokens"] >= 1


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=7,
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 7


def test_n_returns_that_many_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=8, n=2, temperature=1.0
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content for c in reply.choices)


def test_stop_sequence_ends_generation_before_it(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="smollm2", prompt="1, 2, 3, 4, 5, 6,", max_tokens=30, temperature=0, stop=[" 9"]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert " 9" not in reply.choices[0].text
    assert "7" in reply.choices[0].text


def test_same_seed_gives_the_same_sample(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Name a random animal."}],
            max_tokens=12,
            temperature=1.0,
            seed=seed,
        )
        return reply.choices[0].message.content

    assert sample(1234) == sample(1234)


def test_completion_streams_text(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=10, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
    assert all(c.usage is None for c in chunks)


async def test_async_chat_stream_with_usage(cluster: RunningCluster) -> None:
    aclient = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)

    async def one() -> tuple[str, openai.types.CompletionUsage | None]:
        stream = await aclient.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    results = await asyncio.gather(*(one() for _ in range(6)))
    for text, usage in results:
        assert text.strip()
        assert usage is not None and 1 <= usage.completion_tokens <= 16
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_models_health_and_ready(cluster: RunningCluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["smollm2"]
    assert get_json(cluster.url + "/health") == (200, {"status": "ok"})
    status, body = get_json(cluster.url + "/ready")
    assert status == 200 and body["models"] == {"smollm2": 2}


def test_requests_spread_over_both_replicas(cluster: RunningCluster, client: openai.OpenAI) -> None:
    before = {r["id"]: r["served"] for r in cluster.status()["replicas"]}
    for i in range(6):
        question = [{"role": "user", "content": f"Question {i}: name a colour."}]
        client.chat.completions.create(model="smollm2", messages=question, max_tokens=2)
    after = {r["id"]: r["served"] for r in cluster.status()["replicas"]}
    assert all(after[k] > before[k] for k in after)


def test_bad_input_through_the_real_cluster(cluster: RunningCluster) -> None:
    request = urllib.request.Request(
        cluster.base_url + "/chat/completions",
        data=b'{"model": "smollm2", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400
    assert json.load(info.value)["error"]["type"] == "invalid_request_error"


def test_client_disconnect_stops_generation_on_the_replica(cluster: RunningCluster) -> None:
    body = json.dumps(
        {
            "model": "smollm2",
            "max_tokens": 2000,
            "stream": True,
            "temperature": 1.0,
            "messages": [{"role": "user", "content": "Write a very long essay about rivers."}],
        }
    )
    request = urllib.request.Request(
        cluster.base_url + "/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=30)
    response.readline()
    replica = next(r for r in cluster.status()["replicas"] if r["outstanding"] == 1)
    response.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        current = next(r for r in cluster.status()["replicas"] if r["id"] == replica["id"])
        if current["outstanding"] == 0 and current["running"] == 0:
            break
        time.sleep(0.2)
    assert current["outstanding"] == 0 and current["running"] == 0
    assert current["generated_tokens_total"] < replica["generated_tokens_total"] + 1000


def test_status_command_shows_replicas(cluster: RunningCluster) -> None:
    out = subprocess.run(
        [*CORRAL, "status", "--url", cluster.url],
        capture_output=True,
        text=True,
        timeout=30,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "smollm2-0" in out.stdout and "smollm2-1" in out.stdout
    assert out.stdout.count("ready") == 2
    as_json = subprocess.run(
        [*CORRAL, "status", "--url", cluster.url, "--json"], capture_output=True, text=True, timeout=30
    )
    assert {r["state"] for r in json.loads(as_json.stdout)["replicas"]} == {"ready"}


def test_max_tokens_beyond_the_context_is_refused_at_once(client: openai.OpenAI) -> None:
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=100000)
    assert time.monotonic() - started < 5  # not held until the read timeout
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "max_tokens"
    assert error["code"] == "context_length_exceeded" and "2048" in error["message"]  # tests/data context


def test_llama_cpp_gaps_are_made_up_for_by_the_gateway(client: openai.OpenAI) -> None:
    """llama-server alone counts one choice's usage for n > 1 and prompt lists and ignores echo."""
    extra = {"ignore_eos": True}
    two = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=5, n=2, extra_body=extra
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage is not None and two.usage.completion_tokens == 10
    single = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=4, extra_body=extra)
    listed = client.completions.create(
        model="smollm2", prompt=["Hello", "The sky is"], max_tokens=4, n=2, extra_body=extra
    )
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert listed.usage is not None and listed.usage.completion_tokens == 16
    assert single.usage is not None and listed.usage.prompt_tokens > single.usage.prompt_tokens
    plain = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0)
    echoed = client.completions.create(
        model="smollm2", prompt="The sky is", max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The sky is" + plain.choices[0].text


def test_what_cannot_be_made_up_for_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    cases = [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]},
            "messages[0].content[1]",
        ),
        (  # a part with no type, read by its key (as vLLM reads one)
            {"messages": [{"role": "user", "content": [{"image_url": image["image_url"]}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": MESSAGES, "n": 2, "stream": True}, "n"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="smollm2", max_tokens=4, **body)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, echo=True, stream=True)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "echo"
