"""The catalogs: what the issue promised is there, each figure cites a source, users can add entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.perf import CatalogError, load_catalog

GPUS = [
    "l4",
    "l40s",
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "b200",
    "rtx-3090",
    "rtx-4090",
    "rtx-6000-ada",
]
MODELS = [
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "llama-4-scout",
    "llama-4-maverick",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-32b",
    "qwen3-235b-a22b",
    "mistral-7b",
    "mixtral-8x7b",
    "deepseek-v3",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "smollm2-135m",
]


def test_required_entries_exist_and_cite_a_source() -> None:
    catalog = load_catalog()
    assert set(GPUS) <= set(catalog.gpus.names())
    assert set(MODELS) <= set(catalog.models.names())
    assert {"bf16", "fp8", "int8", "awq", "gptq", "gguf-q4", "gguf-q8"} <= set(catalog.quantizations.names())
    for table in (catalog.gpus, catalog.models, catalog.quantizations, catalog.apis):
        for entry in table:
            assert len(entry.source) > 10, entry.name


def test_models_are_found_by_hugging_face_id_and_alias() -> None:
    catalog = load_catalog()
    assert catalog.models.get("meta-llama/Llama-3.1-70B-Instruct").name == "llama-3.1-70b"
    assert catalog.quantizations.get("FP16").name == "bf16"


def test_unknown_name_suggests_close_ones() -> None:
    with pytest.raises(CatalogError, match="did you mean l40s"):
        load_catalog().gpus.get("l40")


def test_user_file_adds_and_overrides_entries(tmp_path: Path) -> None:
    extra = tmp_path / "mine.yaml"
    extra.write_text(
        "gpus:\n"
        "  - {name: l40s, memory_gb: 48, bandwidth_gbs: 864, bf16_tflops: 362, fp8_tflops: 733,\n"
        "     interconnect_gbs: 32, gpus_per_node: 8, tdp_w: 350, price_per_hour: 0.99}\n"
        "  - {name: mi300x, memory_gb: 192, bandwidth_gbs: 5300, bf16_tflops: 1307, fp8_tflops: 2615,\n"
        "     interconnect_gbs: 448, gpus_per_node: 8, tdp_w: 750, price_per_hour: 3.0,\n"
        "     source: AMD datasheet}\n"
    )
    catalog = load_catalog([extra])
    assert catalog.gpus.get("l40s").price_per_hour == 0.99
    assert catalog.gpus.get("mi300x").memory_gb == 192
    assert "user catalog" in catalog.gpus.get("l40s").source


def test_bad_user_file_is_a_clear_error(tmp_path: Path) -> None:
    extra = tmp_path / "bad.yaml"
    extra.write_text("gpus:\n  - {name: x, memory_gb: 1, colour: red}\n")
    with pytest.raises(CatalogError, match="unknown fields colour"):
        load_catalog([extra])
