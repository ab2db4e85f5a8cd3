"""Every benchmark has its page, and the page its raw figures: the JSON the script printed for the table of
record, committed beside the page and linked from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
PAGES = ROOT / "docs" / "benchmarks"


def test_every_benchmark_page_links_its_raw_json_beside_it() -> None:
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    assert len(scripts) >= 18
    missing = []
    for name in scripts:
        page = PAGES / f"{name}.md"
        text = page.read_text(encoding="utf-8") if page.is_file() else ""
        linked = [m for m in re.findall(r"\]\(([\w.-]+\.json)\)", text) if m.startswith(name)]
        if not linked:
            missing.append(f"{name}: no page, or the page links no {name}*.json beside it")
        for file in linked:
            data = json.loads((PAGES / file).read_text(encoding="utf-8"))  # a broken file fails here
            assert data, f"{file} is empty"
    assert missing == []


def test_the_cpu_calibration_record_is_the_corpus_the_planner_reads() -> None:
    record = json.loads((PAGES / "cpu_calibration.json").read_text(encoding="utf-8"))
    corpus = yaml.safe_load((ROOT / "src" / "corral" / "perf" / "data" / "measured_cpu.yaml").read_text())
    assert record["figures"] == corpus["points"] and len(record["figures"]) >= 30
