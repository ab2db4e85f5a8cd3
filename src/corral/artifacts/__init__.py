"""Artifacts fetched into corral's cache: model files and engine binaries."""

from corral.artifacts.bert_gguf import gguf_from_bert, is_embedding_folder
from corral.artifacts.llamacpp import build_llama_server, find_llama_server, llama_server
from corral.artifacts.models import ArtifactError, Progress, resolve_model

__all__ = [
    "ArtifactError",
    "Progress",
    "build_llama_server",
    "find_llama_server",
    "gguf_from_bert",
    "is_embedding_folder",
    "llama_server",
    "resolve_model",
]
