"""Artifacts fetched into corral's cache: model files, LoRA adapters and engine binaries."""

from corral.artifacts.adapters import BaseLayout, adapter_gguf, adapter_rank, peft_to_gguf, resolve_adapter
from corral.artifacts.bert_gguf import gguf_from_bert, is_embedding_folder
from corral.artifacts.errors import ArtifactError, ArtifactTimeout
from corral.artifacts.llamacpp import build_llama_server, find_llama_server, llama_server
from corral.artifacts.models import Progress, resolve_model

__all__ = [
    "ArtifactError",
    "ArtifactTimeout",
    "BaseLayout",
    "Progress",
    "adapter_gguf",
    "adapter_rank",
    "build_llama_server",
    "find_llama_server",
    "gguf_from_bert",
    "is_embedding_folder",
    "llama_server",
    "peft_to_gguf",
    "resolve_adapter",
    "resolve_model",
]
