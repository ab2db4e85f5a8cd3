"""Artifacts made once: the marker is written only after a build that finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.artifacts.locks import build_once


def test_a_build_runs_once_and_a_failed_one_is_redone(tmp_path: Path) -> None:
    marker, lock, runs = tmp_path / "thing" / ".ready", tmp_path / ".thing.lock", []

    def failing() -> str:
        runs.append("failed")
        raise RuntimeError("interrupted")

    def working() -> str:
        runs.append("built")
        marker.parent.mkdir(exist_ok=True)
        return "v1"

    with pytest.raises(RuntimeError):
        build_once(marker, lock, failing)
    assert not marker.exists()
    build_once(marker, lock, working)
    build_once(marker, lock, working)
    assert runs == ["failed", "built"] and marker.read_text() == "v1\n"
