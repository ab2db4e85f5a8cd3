"""Convert a GGUF model into a Hugging Face folder (safetensors, config, tokenizer with chat template).

Runs inside vLLM's own environment (it needs torch, transformers, gguf, accelerate), as a script:
    python gguf_to_hf.py MODEL.gguf OUT_DIR DTYPE
It imports nothing from corral.
"""

import sys
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(
        source.parent,
        gguf_file=source.name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(gguf_file=source.name, dequantize=True),
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights are dequantized now
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
