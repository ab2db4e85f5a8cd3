"""The process environment: where corral keeps its cache, and the admin key. The only reader of it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    """Where corral keeps its cache (models, engine builds) and replica logs."""

    home: Path

    @classmethod
    def from_env(cls) -> Paths:
        """`CORRAL_HOME`, else `$XDG_CACHE_HOME/corral`, else `~/.cache/corral`."""
        explicit = os.environ.get("CORRAL_HOME")
        if explicit:
            return cls(Path(explicit).expanduser())
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        return cls(base / "corral")

    @property
    def models(self) -> Path:
        return self.home / "models"

    @property
    def engines(self) -> Path:
        return self.home / "engines"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def database_url(self) -> str:
        return f"sqlite:///{self.home / 'corral.db'}"


def api_key_from_env(given: str | None) -> str | None:
    """A tenant's API key for the CLI: the one given, else `CORRAL_API_KEY`, else `OPENAI_API_KEY`."""
    return given or os.environ.get("CORRAL_API_KEY") or os.environ.get("OPENAI_API_KEY")


def admin_key_from_env(configured: str | None) -> str | None:
    """The admin key: `CORRAL_ADMIN_KEY` if set (without the whitespace around it: a Kubernetes Secret
    made from a file keeps the file's last line break), else the spec's."""
    return (os.environ.get("CORRAL_ADMIN_KEY") or "").strip() or configured


DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"


def gateway_url_from_env() -> tuple[str, str] | None:
    """A gateway address from the environment and where it came from: `CORRAL_URL`, else
    `OPENAI_BASE_URL` (what `corral up` tells clients to export; its `/v1` is dropped)."""
    if url := os.environ.get("CORRAL_URL"):
        return url.rstrip("/"), "$CORRAL_URL"
    if url := os.environ.get("OPENAI_BASE_URL"):
        return url.rstrip("/").removesuffix("/v1"), "$OPENAI_BASE_URL"
    return None
