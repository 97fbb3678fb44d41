"""Read a safetensors file defensively: the header is checked before any tensor is allocated.

Layout: 8 bytes little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data region, which the tensors must tile exactly. Uploaded adapters are untrusted, so the
header length is bounded, every claim is checked against the file's real size (a truncated
file or a header claiming huge tensors is refused before allocating), and tensors are read by
plain byte offsets: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER_BYTES = 16 << 20  # a LoRA header is ~150 bytes per tensor; 16 MiB is ~100k tensors

ITEM_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header record; `start`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str  # safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[dict[str, TensorEntry], list[str]]:
    """Parse and check the header of `path` without reading tensor data.

    Returns the entries that are well-formed and every problem found (empty when the file is
    sound). A problem with the file's framing (length, JSON) returns no entries.
    """
    name = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return {}, [f"{name}: truncated ({size} bytes), not a safetensors file"]
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                return {}, [
                    f"{name}: header claims {header_len} bytes, over the "
                    f"{MAX_HEADER_BYTES}-byte limit (corrupt or not a safetensors file)"
                ]
            if 8 + header_len > size:
                return {}, [
                    f"{name}: truncated: header claims {header_len} bytes but the file has "
                    f"{size} bytes"
                ]
            raw = f.read(header_len)
        header = json.loads(raw)
    except OSError as e:
        return {}, [f"{name}: cannot read: {e}"]
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        return {}, [f"{name}: header is not valid JSON ({e})"]
    if not isinstance(header, dict):
        return {}, [f"{name}: header is not a JSON object"]

    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries, problems = {}, []
    for key, rec in header.items():
        if key == "__metadata__":
            continue
        entry = _entry(key, rec, data_start, data_size)
        if isinstance(entry, str):
            problems.append(f"{name}: tensor {key!r}: {entry}")
        else:
            entries[key] = entry
    if not problems:
        problems += _check_tiling(name, entries, data_start, data_size)
    return entries, problems


def _entry(key: str, rec: object, data_start: int, data_size: int) -> TensorEntry | str:
    """The checked entry, or a string naming what is wrong with it."""
    if not isinstance(rec, dict):
        return "header record is not an object"
    dtype, shape, offsets = rec.get("dtype"), rec.get("shape"), rec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEM_SIZE:
        return f"unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"bad shape {shape!r}"
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(map(_is_count, offsets))
        and offsets[0] <= offsets[1]
    ):
        return f"bad data_offsets {offsets!r}"
    nbytes = math.prod(shape) * ITEM_SIZE[dtype]
    begin, end = offsets
    if max(end, nbytes) > data_size:
        return (
            f"claims {nbytes} bytes (shape {shape}, bytes {begin}..{end}) but the file has only "
            f"{data_size} bytes of data (truncated or corrupt)"
        )
    if end - begin != nbytes:
        return f"data_offsets span {end - begin} bytes but shape {shape} x {dtype} needs {nbytes}"
    return TensorEntry(key, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tiling(
    name: str, entries: dict[str, TensorEntry], data_start: int, data_size: int
) -> list[str]:
    """The tensors must cover the data region exactly, without overlap (as safetensors does)."""
    pos = data_start
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start != pos:
            return [f"{name}: tensor {e.name!r} overlaps another or leaves a gap in the data"]
        pos = e.end
    if pos != data_start + data_size:
        return [f"{name}: {data_start + data_size - pos} trailing bytes after the last tensor"]
    return []


def read_tensors(path: Path, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Read checked float tensors (dtype in FLOAT_DTYPES) into fresh CPU tensors, by offset.

    safetensors is little-endian, as are the machines this runs on.
    """
    out = {}
    with path.open("rb") as f:
        for e in entries:
            f.seek(e.start)
            buf = bytearray(f.read(e.end - e.start))
            if len(buf) != e.end - e.start:
                raise OSError(f"{path.name}: truncated while reading {e.name!r}")
            dtype = FLOAT_DTYPES[e.dtype]
            out[e.name] = (
                torch.frombuffer(buf, dtype=dtype).reshape(e.shape)
                if buf
                else torch.empty(e.shape, dtype=dtype)
            )
    return out
