"""An exclusive lock on a file, so two corral processes never fetch or build the same artifact at once, and
`build_once` for artifacts finished by a marker file."""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["build_once", "file_lock"]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(marker: Path, lock: Path, build: Callable[[], str]) -> None:
    """Run `build` unless `marker` exists, under `lock` (checked again inside), then write its text to
    `marker`: an interrupted build leaves no marker and is redone."""
    if marker.exists():
        return
    with file_lock(lock):
        if marker.exists():
            return
        text = build()
        marker.write_text(text + "\n")
