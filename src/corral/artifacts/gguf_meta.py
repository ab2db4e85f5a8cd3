"""A GGUF file's metadata (its chat template, its architecture) and tensor shapes, read from the header
alone by a bounded walk: `gguf`'s reader maps every tensor first (4.6 s for SmolLM2-135M) and believes the
counts it reads (an array claiming 2^63 elements keeps it busy for good); this walks the key-value pairs
(the vocabulary's strings included), checks every length and count against the bytes left in the file
before it reads or skips them, and stops once it has what it was asked for."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["GGUFError", "Scalar", "gguf_fields", "gguf_string", "gguf_tensor_dims"]

Scalar = str | int | float | bool

# scalar value types: their struct format (8: string, 9: array are read apart)
_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)  # GGUF v1 (32-bit lengths) is long gone; `gguf`'s reader takes these two
_MAX_KEY = 65535  # the GGUF spec's longest key (and tensor name)
_MAX_NESTING = 2  # an array of arrays at most (GGUF's writers nest one level; llama.cpp reads none)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ITEMS = 1 << 22  # array elements walked in a header at most (the largest vocabularies and merges: ~1M)
_WINDOW = 1 << 20  # bytes read at once


class GGUFError(ValueError):
    """The file is not GGUF, or its header is malformed: a length or count past the file's end, a value
    type that does not exist, arrays nested too deep, a string that is not UTF-8."""


def gguf_string(path: Path, key: str) -> str | None:
    """The string value of `key` in the GGUF file's metadata; None if it has none, is not GGUF, or cannot
    be read."""
    try:
        with _header(path) as (reader, _tensors, count):
            for name, value in _pairs(reader, count, lambda name: name == key):
                if name == key:
                    return value if isinstance(value, str) else None
    except (OSError, GGUFError):
        return None
    return None


def gguf_fields(path: Path, wanted: Callable[[str], bool]) -> dict[str, Scalar | None]:
    """The values of the metadata keys `wanted` accepts (None for an array); GGUFError for a file that is
    not GGUF or whose header is malformed, OSError for one that cannot be read."""
    with _header(path) as (reader, _tensors, count):
        return dict(_pairs(reader, count, wanted))


def gguf_tensor_dims(path: Path, suffix: str) -> tuple[int, ...] | None:
    """The dimensions (ggml's order: the fastest first) of the first tensor whose name ends with `suffix`;
    None when none does. GGUFError or OSError as `gguf_fields`."""
    with _header(path) as (reader, tensors, count):
        for _ in _pairs(reader, count, lambda _: False):
            pass
        reader.check_count(tensors, 8 + 4 + 4 + 8)  # (a name's length, its dimensions, type, offset)
        for _ in range(tensors):
            name = reader.string(_MAX_KEY)
            (dims,) = reader.ints("<I")
            if dims > _MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {dims} dimensions (at most {_MAX_DIMS})")
            shape = reader.ints(f"<{dims}Q")
            reader.skip(4 + 8)  # its type and offset
            if name.endswith(suffix):
                return shape
    return None


@contextmanager
def _header(path: Path) -> Iterator[tuple[_Reader, int, int]]:
    """The file's reader past the header's start, its tensor count and its key-value count (read a window
    at a time with `pread`: a file cut short while read is a GGUFError, where a mapped one killed the
    process with SIGBUS)."""
    with path.open("rb") as file:
        reader = _Reader(file.fileno(), os.fstat(file.fileno()).st_size)
        if reader.take(4) != b"GGUF":
            raise GGUFError("not a GGUF file")
        version, tensors, count = reader.ints("<IQQ")
        if version not in _VERSIONS:
            raise GGUFError(f"GGUF version {version}, not 2 or 3")
        yield reader, tensors, count


def _pairs(reader: _Reader, count: int, wanted: Callable[[str], bool]) -> Iterator[tuple[str, Scalar | None]]:
    """Each wanted key and its value (None for an array), skipping the others."""
    reader.check_count(count, 8 + 4)  # (a key's length, its value's type)
    for _ in range(count):
        name = reader.string(_MAX_KEY)
        (kind,) = reader.ints("<I")
        if wanted(name):
            yield name, reader.value(kind)
        else:
            reader.skip_value(kind, 0)


class _Reader:
    """Reads a GGUF header, each length and count checked against the bytes left before it is used, and the
    items it walks (array elements) counted: past `_MAX_ITEMS` the header is refused (a file of empty
    strings or arrays would otherwise cost a Python step each: minutes for a few GiB)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.at = 0
        self.walked = 0
        self._buf = b""  # the file's bytes from `_base` on: a window read at once
        self._base = 0

    def left(self) -> int:
        return self.size - self.at

    def _window(self, length: int) -> tuple[bytes, int]:
        """A buffer holding the `length` bytes at `at`, and where they start in it."""
        if length > self.size - self.at:
            raise GGUFError(f"a length of {length} bytes runs past the file's end")
        off = self.at - self._base
        if off < 0 or off + length > len(self._buf):
            self._buf, self._base, off = os.pread(self.fd, max(length, _WINDOW), self.at), self.at, 0
            if len(self._buf) < length:  # (the file shrank while read)
                raise GGUFError("the file ends early")
        return self._buf, off

    def take(self, length: int) -> bytes:
        buf, off = self._window(length)
        self.at += length
        return buf[off : off + length]

    def skip(self, length: int) -> None:
        if length > self.size - self.at:
            raise GGUFError(f"a length of {length} bytes runs past the file's end")
        self.at += length

    def walk(self, count: int) -> None:
        """Count `count` items more walked one by one."""
        self.walked += count
        if self.walked > _MAX_ITEMS:
            raise GGUFError(f"a header of more than {_MAX_ITEMS:,} items")

    def check_count(self, count: int, least: int) -> None:
        """Refuse `count` items of at least `least` bytes each that the bytes left cannot hold."""
        if count * least > self.left():
            raise GGUFError(f"a count of {count} items runs past the file's end")

    def unpack(self, fmt: str) -> tuple[int | float | bool, ...]:
        size = struct.calcsize(fmt)
        buf, off = self._window(size)
        values: tuple[int | float | bool, ...] = struct.unpack_from(fmt, buf, off)
        self.at += size
        return values

    def ints(self, fmt: str) -> tuple[int, ...]:
        """Unsigned whole numbers (lengths, counts, types) in the struct format `fmt`."""
        return tuple(int(n) for n in self.unpack(fmt))

    def string(self, longest: int | None = None) -> str:
        (length,) = self.ints("<Q")
        if longest is not None and length > longest:
            raise GGUFError(f"a name of {length} bytes (at most {longest})")
        try:
            return self.take(length).decode()
        except UnicodeDecodeError as exc:
            raise GGUFError(f"a string is not UTF-8: {exc}") from None

    def value(self, kind: int) -> Scalar | None:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            self.skip_value(kind, 0)
            return None
        return self.unpack(_format(kind))[0]

    def skip_value(self, kind: int, depth: int) -> None:
        """Skip one value of type `kind`, inside `depth` arrays."""
        if kind == _STRING:
            (length,) = self.ints("<Q")
            self.skip(length)
        elif kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise GGUFError(f"arrays nested more than {_MAX_NESTING} deep")
            inner, count = self.ints("<IQ")
            if inner not in (_STRING, _ARRAY):
                size = struct.calcsize(_format(inner))
                self.check_count(count, size)
                self.skip(count * size)
                return
            self.check_count(count, 8 if inner == _STRING else 4 + 8)
            self.walk(count)
            if inner == _STRING:  # (a vocabulary: the common long array, walked by its lengths alone)
                self._skip_strings(count)
                return
            for _ in range(count):
                self.skip_value(inner, depth + 1)
        else:
            self.skip(struct.calcsize(_format(kind)))

    def _skip_strings(self, count: int) -> None:
        at, size, buf, base = self.at, self.size, self._buf, self._base
        length_at = _LENGTH.unpack_from
        for _ in range(count):
            off = at - base
            if off < 0 or off + 8 > len(buf):  # (past the window: the next one read)
                self.at = at
                buf, off = self._window(8)
                base = self._base
            at += 8 + length_at(buf, off)[0]
            if at > size:
                raise GGUFError("a string runs past the file's end")
        self.at = at


_LENGTH = struct.Struct("<Q")


def _format(kind: int) -> str:
    fmt = _FORMATS.get(kind)
    if fmt is None:
        raise GGUFError(f"value type {kind} does not exist")
    return fmt
