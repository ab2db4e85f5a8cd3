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


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "models:\n  - {name: bad, params_b: 7, layers: 32, hidden: 4096, heads: 32, kv_heads: 0,\n"
            "     head_dim: 128, ffn: 14336, vocab: 32000, max_context: 8192}\n",
            "bad: kv_heads must be above 0, not 0",
        ),
        (
            "gpus:\n  - {name: free, memory_gb: 80, bandwidth_gbs: 0, bf16_tflops: 900, fp8_tflops: null,\n"
            "     interconnect_gbs: 100, gpus_per_node: 8, tdp_w: 700, price_per_hour: 2}\n",
            "free: bandwidth_gbs must be above 0, not 0",
        ),
        (
            "gpus:\n  - {name: owed, memory_gb: 80, bandwidth_gbs: 2000, bf16_tflops: .nan,\n"
            "     fp8_tflops: null, interconnect_gbs: 100, gpus_per_node: 8, tdp_w: 0, price_per_hour: -1}\n",
            "owed: bf16_tflops must be a finite number, not nan",
        ),
        (
            "models:\n  - {name: half, params_b: 7, layers: 32.5, hidden: 4096, heads: 32, kv_heads: 8,\n"
            "     head_dim: 128, ffn: 14336, vocab: 32000, max_context: 8192}\n",
            "half: layers must be a whole number, not 32.5",
        ),
        (
            "apis:\n  - {name: paid, input_per_m: -0.1, output_per_m: 1}\n",
            "paid: input_per_m must be 0 or more",
        ),
    ],
)
def test_a_user_entry_with_a_figure_the_planner_cannot_use_is_a_clear_error(
    tmp_path: Path, entry: str, message: str
) -> None:
    """A KV head count of 0 was a modulo by zero deep in the search, a bandwidth of 0 a division by zero:
    the entry and the field are named as the catalog loads. A free card (price 0) is fine."""
    extra = tmp_path / "mine.yaml"
    extra.write_text(entry)
    with pytest.raises(CatalogError, match=message):
        load_catalog([extra])
    extra.write_text(
        "gpus:\n  - {name: owned, memory_gb: 80, bandwidth_gbs: 2000, bf16_tflops: 300, fp8_tflops: null,\n"
        "     interconnect_gbs: 100, gpus_per_node: 8, tdp_w: 0, price_per_hour: 0}\n"
    )
    assert load_catalog([extra]).gpus.get("owned").price_per_hour == 0


def test_q4_0_and_q4_1_gguf_weights_take_their_block_sizes() -> None:
    """llama.cpp's blocks of 32 weights: Q4_0 is 16 bytes of nibbles and an fp16 scale (18 bytes, 4.5
    bits a weight), Q4_1 adds an fp16 minimum (20 bytes, 5.0). `q4_0` was an alias of the Q4_1 entry."""
    quantizations = load_catalog().quantizations
    assert quantizations.get("q4_0").bits == 18 * 8 / 32
    assert quantizations.get("q4_1").bits == quantizations.get("gguf-q4").bits == 20 * 8 / 32
