"""Read and check safetensors headers without loading tensor data."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from specpack.errors import ConversionError

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
TORCH_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
               "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
               "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
ST_NAMES = {v: k for k, v in TORCH_NAMES.items()}
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def st_dtype(tensor) -> str:
    """The safetensors name of a torch tensor's dtype (F8_E4M3 for torch.float8_e4m3fn)."""
    name = str(tensor.dtype).removeprefix("torch.")
    return ST_NAMES.get(name, name)


def read_header(path: Path) -> dict[str, TensorMeta]:
    """Parse `path`'s header and check that every tensor lies where its header says it does."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        n = header_length(f.read(8), size, path)
        return parse_header(f.read(n), n, size, path)


def header_length(raw_len: bytes, size: int, where) -> int:
    """The header's byte length from a file's first 8 bytes, bounded by the file (`size`) and
    MAX_HEADER_BYTES before anything trusts it."""
    if len(raw_len) < 8:
        raise _bad(where, ["file is shorter than the 8-byte header length"])
    (n,) = struct.unpack("<Q", raw_len)
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise _bad(where, [f"header length {n} exceeds the file ({size} bytes)"])
    return n


def parse_header(raw: bytes, n: int, size: int, where) -> dict[str, TensorMeta]:
    """The `n` header bytes of a file of `size` bytes, every entry checked to lie inside the file."""
    if len(raw) != n:
        raise _bad(where, [f"header is {len(raw)} bytes, its length field says {n}"])
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(where, [f"header is not valid JSON ({exc})"]) from None
    except RecursionError:  # the parser's own depth limit: a header is 3 levels deep
        raise _bad(where, ["header is nested too deeply to be a safetensors header"]) from None
    if not isinstance(header, dict):
        raise _bad(where, ["header is not a JSON object"])
    header.pop("__metadata__", None)
    tensors, problems = _parse_entries(header)
    problems += _check_layout(tensors, size - 8 - n)
    if problems:
        raise _bad(where, problems)
    return tensors


def data_start(path: Path) -> int:
    """Byte offset of the first tensor's data in a safetensors file (8 + header length)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def tensor_sha256(path: Path, meta: TensorMeta) -> str:
    """SHA-256 of one tensor's bytes as stored (read in chunks; nothing decoded)."""
    import hashlib

    digest, chunk, left = hashlib.sha256(), 1 << 24, meta.end - meta.start
    with open(path, "rb") as f:
        f.seek(data_start(path) + meta.start)
        while left:
            data = f.read(min(chunk, left))
            if not data:
                break
            digest.update(data)
            left -= len(data)
    return digest.hexdigest()


def _parse_entries(header: dict) -> tuple[dict[str, TensorMeta], list[str]]:
    tensors, problems = {}, []
    for name, entry in header.items():
        try:
            dtype, shape, offsets = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if dtype not in DTYPE_BYTES or not isinstance(offsets, list) or len(offsets) != 2 \
                    or not all(_natural(d) for d in (*shape, *offsets)):
                raise ValueError
            start, end = offsets
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: malformed entry {json.dumps(entry)[:120]}")
            continue
        meta = TensorMeta(dtype, shape, start, end)
        if end - start != meta.numel * DTYPE_BYTES[dtype]:
            problems.append(f"{name}: {dtype}{list(shape)} needs {meta.numel * DTYPE_BYTES[dtype]} "
                            f"bytes but its offsets span {end - start}")
        tensors[name] = meta
    return tensors, problems


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(tensors: dict[str, TensorMeta], data_len: int) -> list[str]:
    problems, cursor = [], 0
    for name, meta in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if meta.start != cursor:
            problems.append(f"{name}: data starts at byte {meta.start}, expected {cursor} "
                            "(overlap or gap)")
        if meta.end > data_len:
            problems.append(f"{name}: data ends at byte {meta.end}, past the end of the file "
                            f"({data_len} data bytes): truncated?")
        cursor = max(cursor, meta.end)
    if cursor < data_len:
        problems.append(f"{data_len - cursor} trailing bytes after the last tensor")
    return problems


def _bad(path: Path, problems: list[str]) -> ConversionError:
    return ConversionError(f"{path}: safetensors header does not match the file", problems=problems,
                           hint="the file is corrupt or truncated: download or export it again")
