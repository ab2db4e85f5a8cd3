"""A BERT-class sentence-embedding model (a Hugging Face folder: safetensors + tokenizer.json) as a GGUF
file that llama.cpp's server embeds with (`--embeddings`), converted once into corral's cache.

llama.cpp's own converter needs PyTorch; this one reads the weights with safetensors' numpy loader and
writes with `gguf` (llama.cpp's Python package), whose tensor-name map gives the GGUF names. Matrices are
stored as float16; vectors (biases, norms) and the position and token-type tables that are added to
activations as float32, as llama.cpp's converter does. The tokenizer is
written in llama.cpp's WordPiece form: a word-initial piece carries the phantom space `▁`, a `##`
continuation loses its marker, bracketed special tokens stay as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from corral.artifacts.locks import build_once
from corral.artifacts.models import ArtifactError, Progress
from corral.config import Paths

__all__ = ["gguf_from_bert", "is_embedding_folder", "max_input_tokens"]

_NORMAL, _CONTROL = 1, 3  # llama.cpp token types
_ADDED_TABLES = ("position_embd.", "token_types.")  # llama.cpp adds them to f32 activations: kept f32
_POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2}  # llama.cpp pooling types


def is_embedding_folder(path: Path) -> bool:
    """A Hugging Face folder of a BERT-class encoder (what this module converts)."""
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("model_type") == "bert")


def gguf_from_bert(folder: Path, paths: Paths, progress: Progress = lambda _: None) -> Path:
    """The GGUF file for the encoder in `folder` (made once; about two seconds for MiniLM-L6)."""
    target = paths.models / "gguf-from-hf" / f"{_folder_id(folder)}.gguf"

    def convert() -> str:
        progress(f"converting {folder.name} to GGUF for llama.cpp")
        partial = target.with_name(target.name + ".part")
        _write(folder, partial)
        os.replace(partial, target)
        return str(target)

    target.parent.mkdir(parents=True, exist_ok=True)
    build_once(target.with_suffix(".done"), target.with_suffix(".lock"), convert)
    return target


def _folder_id(folder: Path) -> str:
    """A cache name that changes when the folder or its weights do."""
    weights = folder / "model.safetensors"
    stat = weights.stat() if weights.is_file() else folder.stat()
    where = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    return f"{folder.name}-{where}-{stat.st_size}-{int(stat.st_mtime)}"


def max_input_tokens(folder: Path) -> int | None:
    """The longest input the encoder was trained on: sentence-transformers' max_seq_length, else its
    position table."""
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("config.json", "max_position_embeddings"),
    ):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _write(folder: Path, out: Path) -> None:
    import gguf  # heavy imports, only when converting
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        raise ArtifactError(f"{folder} has no model.safetensors to convert")
    blocks = int(config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_name(folder.name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(blocks)
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-12)))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(_pooling(folder)))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _write_vocab(writer, folder, int(config.get("type_vocab_size", 2)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, blocks)
    for name, tensor in load_file(str(weights_file)).items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # sentence embeddings pool the last hidden states; the pooler head is unused
        mapped = names.get_name(name.removeprefix("bert."), try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ArtifactError(f"cannot convert {folder}: no GGUF name for tensor {name}")
        half = tensor.ndim > 1 and not mapped.startswith(_ADDED_TABLES)  # tables added to activations: f32
        data = tensor.astype(np.float16 if half else np.float32)
        writer.add_tensor(mapped, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _pooling(folder: Path) -> int:
    """Mean pooling unless the sentence-transformers pooling config says CLS."""
    config_file = folder / "1_Pooling" / "config.json"
    if not config_file.is_file():
        return _POOLING["pooling_mode_mean_tokens"]
    config: dict[str, Any] = json.loads(config_file.read_text())
    for key, kind in _POOLING.items():
        if config.get(key):
            return kind
    raise ArtifactError(f"{config_file}: only mean or CLS pooling can be served by llama.cpp")


def _write_vocab(writer: Any, folder: Path, type_vocab: int) -> None:
    import gguf

    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ArtifactError(f"{folder} has no tokenizer.json to convert")
    tokenizer = json.loads(tokenizer_file.read_text())
    if tokenizer["model"].get("type") != "WordPiece":
        raise ArtifactError(f"{tokenizer_file}: only WordPiece (BERT) tokenizers can be converted")
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_type_count(type_vocab)
    writer.add_token_list([_phantom(t, t in special) for t in tokens])
    writer.add_token_types([_CONTROL if t in special else _NORMAL for t in tokens])
    gguf.SpecialVocab(folder, load_merges=False, n_vocab=len(tokens)).add_to_gguf(writer)


def _phantom(token: str, special: bool) -> str:
    if special or (token.startswith("[") and token.endswith("]")):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token
