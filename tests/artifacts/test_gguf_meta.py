"""The bounded GGUF header walk: a hostile header (a length or count past the file's end, a type that does
not exist, arrays nested deep) is unreadable at once, never an allocation of what it claims, a long walk or
a Python error."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from corral.artifacts.gguf_meta import GGUFError, gguf_fields, gguf_string, gguf_tensor_dims

TEMPLATE = "tokenizer.chat_template"


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(pairs: int, tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, pairs)


# each a header that claims what its file cannot hold, or a type GGUF has not
HOSTILE = {
    "unknown_type": _header(2)
    + _s(b"a")
    + struct.pack("<I", 13)
    + b"\0" * 8
    + _s(TEMPLATE.encode())
    + struct.pack("<I", 8)
    + _s(b"x"),
    "key_length_2_64": _header(1) + struct.pack("<Q", 2**64 - 1) + b"abc",
    "key_length_2_62": _header(1) + struct.pack("<Q", 2**62) + b"abc",
    "string_to_skip_2_64": _header(2) + _s(b"a") + struct.pack("<I", 8) + struct.pack("<Q", 2**64 - 1),
    "array_of_2_63_bytes": _header(2) + _s(b"a") + struct.pack("<I", 9) + struct.pack("<IQ", 10, 2**63),
    "array_of_2_63_strings": _header(2) + _s(b"a") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 2**63),
    "arrays_nested_5000_deep": _header(1) + _s(b"a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000,
    "arrays_nested_3_deep": _header(1)
    + _s(b"a")
    + struct.pack("<I", 9)
    + struct.pack("<IQ", 9, 1) * 2
    + struct.pack("<IQ", 4, 1)
    + b"\0" * 4,
    "array_of_an_unknown_type": _header(1)
    + _s(b"a")
    + struct.pack("<I", 9)
    + struct.pack("<IQ", 13, 1)
    + b"\0",
    "2_63_pairs": _header(2**63) + _s(b"a") + struct.pack("<I", 4) + b"\0" * 4,
    "key_not_utf8": _header(1) + _s(b"\xff\xfe") + struct.pack("<I", 8) + _s(b"x"),
    "truncated": b"GGUF\x03\0",
    "version_1": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
}


def hostile_ggufs(folder: Path) -> list[Path]:
    """The hostile headers, one file each, in `folder`."""
    files = []
    for name, data in HOSTILE.items():
        (folder / f"{name}.gguf").write_bytes(data)
        files.append(folder / f"{name}.gguf")
    return files


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_header_is_unreadable_not_an_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[name])
    assert gguf_string(path, TEMPLATE) is None
    with pytest.raises(GGUFError):
        gguf_fields(path, lambda _: True)
    with pytest.raises(GGUFError):
        gguf_tensor_dims(path, ".lora_a")


@pytest.mark.parametrize(
    "tensors",
    [
        _header(0, tensors=2**63) + _s(b"t.lora_a") + struct.pack("<I", 2) + struct.pack("<QQ", 1, 1),
        _header(0, tensors=1) + _s(b"t.lora_a") + struct.pack("<I", 5) + struct.pack("<5Q", 1, 1, 1, 1, 1),
        _header(0, tensors=1) + struct.pack("<Q", 2**62) + b"t.lora_a",
    ],
    ids=["2_63_tensors", "5_dimensions", "name_length_2_62"],
)
def test_hostile_tensor_infos_are_unreadable(tmp_path: Path, tensors: bytes) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(tensors + b"\0" * 16)
    assert gguf_fields(path, lambda _: True) == {}  # (no metadata: the tensors come after it)
    with pytest.raises(GGUFError):
        gguf_tensor_dims(path, ".lora_a")


def test_arrays_of_arrays_are_skipped(tmp_path: Path) -> None:
    """An array of arrays of strings (two levels, as GGUF's writer makes) is walked over to the key after."""
    inner = struct.pack("<IQ", 8, 2) + _s(b"ab") + _s(b"c")
    nested = _s(b"merges") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 2) + inner * 2
    path = tmp_path / "nested.gguf"
    path.write_bytes(_header(2) + nested + _s(TEMPLATE.encode()) + struct.pack("<I", 8) + _s(b"{{ x }}"))
    assert gguf_string(path, TEMPLATE) == "{{ x }}"
    assert gguf_fields(path, lambda _: True) == {"merges": None, TEMPLATE: "{{ x }}"}


def test_fields_and_tensor_shapes_are_read_as_gguf_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_uint32("llama.attention.head_count", 9)
    writer.add_bool("flag", True)
    writer.add_float32("adapter.lora.alpha", 16.0)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_fields(path, lambda _: True) == {
        "general.architecture": "llama",
        "general.type": "adapter",
        "llama.attention.head_count": 9,
        "flag": True,
        "adapter.lora.alpha": 16.0,
        "tokenizer.ggml.tokens": None,
    }
    assert gguf_string(path, "general.type") == "adapter"
    assert gguf_string(path, "llama.attention.head_count") is None  # not a string
    assert gguf_tensor_dims(path, ".lora_a") == (64, 4)  # ggml's order: the fastest first
    assert gguf_tensor_dims(path, ".lora_b") is None


def test_a_file_that_is_no_gguf_or_not_there(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not GGUF")
    assert gguf_string(tmp_path / "notes.txt", TEMPLATE) is None
    assert gguf_string(tmp_path / "missing.gguf", TEMPLATE) is None
    assert gguf_string(tmp_path, TEMPLATE) is None  # a folder
    with pytest.raises(GGUFError, match="not a GGUF file"):
        gguf_fields(tmp_path / "notes.txt", lambda _: True)
    with pytest.raises(OSError):
        gguf_fields(tmp_path / "missing.gguf", lambda _: True)


@pytest.mark.parametrize("inner", [8, 9])
def test_a_header_of_millions_of_empty_items_is_refused_without_walking_them(
    tmp_path: Path, inner: int
) -> None:
    """Each empty string or array was a Python step: 8.4M empty strings took 4.8 s, 64 MiB of empty arrays
    19 s (a few GiB: minutes, under the conversion lock). Past 4M items walked the header is refused."""
    count = (1 << 22) + 1
    item = struct.pack("<Q", 0) if inner == 8 else struct.pack("<IQ", 4, 0)
    path = tmp_path / "many.gguf"
    path.write_bytes(
        _header(2) + _s(b"a") + struct.pack("<I", 9) + struct.pack("<IQ", inner, count) + item * count
        + _s(TEMPLATE.encode()) + struct.pack("<I", 8) + _s(b"x")
    )  # fmt: skip
    with pytest.raises(GGUFError, match="items"):
        gguf_fields(path, lambda name: name == TEMPLATE)
    assert gguf_string(path, TEMPLATE) is None


def test_a_file_cut_short_while_read_is_unreadable_not_the_processs_end(tmp_path: Path) -> None:
    """A mapped file cut short under the walk (a model file copied over in place) killed the process
    (SIGBUS): the supervisor and the gateway with it. Run in a child, as it would kill pytest."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(
        _header(3) + _s(b"a") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 300_000)
        + _s(b"xy") * 300_000 + _s(b"b") + struct.pack("<I", 4) + b"\0" * 4
        + _s(TEMPLATE.encode()) + struct.pack("<I", 8) + _s(b"x")
    )  # fmt: skip
    probe = (
        "import os, sys; from pathlib import Path; from corral.artifacts.gguf_meta import gguf_fields\n"
        f"path = Path({str(path)!r})\n"
        "def wanted(name):\n"
        "    os.truncate(path, 4096)  # (after the first key: the rest of the walk reads past the end)\n"
        "    return False\n"
        "try:\n"
        "    gguf_fields(path, wanted)\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("refused:"), (done.returncode, done.stderr)
