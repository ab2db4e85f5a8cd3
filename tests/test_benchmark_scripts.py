"""Every benchmark script imports: a refactor that moves a name they use fails here, not months later
when someone runs the benchmark (routing_replay.py once stopped at its imports unnoticed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_the_benchmarks_are_all_here() -> None:
    assert len(SCRIPTS) >= 18 and (BENCHMARKS / "_harness.py").exists()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_benchmark_script_imports(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their shared `_harness`
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # defines, runs nothing: each script's work is under __main__
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
