"""The PEFT adapter make_adapter.py wrote, as llama.cpp's LoRA GGUF (adapter.gguf beside it).

The conversion is corral's own (corral.artifacts.adapters.peft_to_gguf, which corral runs itself for an
adapter folder without a GGUF); this names the base's layout on the command line instead of reading it
from the base GGUF. Runs in corral's environment (gguf, numpy, safetensors):
    .venv/bin/python scripts/lora/adapter_to_gguf.py ADAPTER_DIR [N_HEAD N_KV_HEAD [ARCHITECTURE]]
(SmolLM2-135M, the default: 9 heads, 3 key-value heads, llama.)
"""

import sys
from pathlib import Path

from corral.artifacts import BaseLayout, peft_to_gguf


def main() -> None:
    folder = Path(sys.argv[1])
    heads, kv_heads = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (9, 3)
    architecture = sys.argv[4] if len(sys.argv) > 4 else "llama"
    peft_to_gguf(folder, folder / "adapter.gguf", BaseLayout(architecture, heads, kv_heads))


if __name__ == "__main__":
    main()
