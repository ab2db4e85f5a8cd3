"""The PEFT adapter make_adapter.py wrote, as llama.cpp's LoRA GGUF (adapter.gguf beside it).

llama.cpp names each pair after its base tensor (blk.N.attn_q.weight.lora_a / .lora_b, A as rank x in,
B as out x rank), reads the scale as adapter.lora.alpha / rank, and keeps q and k rows in the order its
own converter permutes them into (the base GGUF's): B of q_proj (and k_proj) is permuted alike. Runs in
corral's environment (gguf, numpy, safetensors):
    .venv/bin/python scripts/lora/adapter_to_gguf.py ADAPTER_DIR [N_HEAD N_KV_HEAD]
(SmolLM2-135M: 9 heads, 3 key-value heads.)
"""

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows in the order llama.cpp's converter puts q and k rows (rotary halves interleaved per head)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def main() -> None:
    folder = Path(sys.argv[1])
    heads, kv_heads = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (9, 3)
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(folder / "adapter.gguf"), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        base = key.removesuffix(".lora_A.weight")
        layer, projection = int(base.split(".layers.")[1].split(".")[0]), base.rsplit(".", 1)[1]
        a, b = tensors[key], tensors[base + ".lora_B.weight"]
        if projection in ("q_proj", "k_proj"):
            b = _permute(b, heads if projection == "q_proj" else kv_heads)
        name = f"blk.{layer}.{_NAMES[projection]}.weight"
        writer.add_tensor(name + ".lora_a", np.ascontiguousarray(a))
        writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
