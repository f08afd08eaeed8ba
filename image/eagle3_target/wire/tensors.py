"""Safetensors bodies <-> tensors: the native API's wire format.

We write and parse the (simple, documented) safetensors layout ourselves because the library's in-memory
API copies every tensor two or three times; here encoding copies nothing (the `Payload` views each tensor's
memory after a small header) and decoding returns views into the body. Output is byte-compatible with
`safetensors.torch.save`/`load`.
Layout: u64 little-endian header length N, N bytes of JSON header (padded with spaces to a multiple of 8),
then the data; each header entry is {"dtype", "shape", "data_offsets": [begin, end]} relative to the data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from eagle3_target.wire import (
    Payload,
    WireFormatError,
    as_byte_tensor,
    checked_nbytes,
    raw_bytes,
    tensor_at,
)

# In the order the safetensors library lays tensors out (its dtype enum, descending; then by name), which
# also keeps every tensor aligned to its element size.
DTYPES: dict[str, torch.dtype] = {
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "F32": torch.float32,
    "U32": torch.uint32,
    "I32": torch.int32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_RANKS = {dtype: rank for rank, dtype in enumerate(DTYPES.values())}
METADATA_KEY = "__metadata__"
_ALIGN = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_TENSORS = 4096
MAX_NDIM = 32


def encode(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize to safetensors bytes in one buffer (small bodies: requests, tests)."""
    return encode_payload(tensors, metadata).tobytes()


def encode_payload(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> Payload:
    """The safetensors body as segments: the length-prefixed header, then each tensor's own bytes."""
    order = sorted(tensors, key=lambda name: (_RANKS.get(tensors[name].dtype, -1), name))
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map str to str")
        header[METADATA_KEY] = dict(metadata)
    parts: list[memoryview] = []
    offset = 0
    for name in order:
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        data = raw_bytes(t)
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        parts.append(data)
        offset += data.nbytes
    # Non-ASCII as UTF-8, as the library (serde_json) writes it, so the bytes are the library's own.
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % _ALIGN)
    return Payload.of([struct.pack("<Q", len(text)), text, *parts])


def _parse_header(text: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            raise WireFormatError("safetensors header has duplicate keys")
        return obj

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=no_duplicates)
    # ValueError also covers JSONDecodeError, UnicodeDecodeError and integers too long to convert.
    except (ValueError, RecursionError) as exc:
        raise WireFormatError(f"safetensors header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireFormatError("safetensors header must be a JSON object")
    return header


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode(
    buf: bytes | bytearray | memoryview,
    *,
    max_tensors: int = MAX_TENSORS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Parse a safetensors body strictly into (tensors, metadata).

    Tensors are views of the body when it is writable (pass a bytearray to avoid any copy), else of one
    private copy. The data section must be covered exactly, without gaps or overlaps, as the format requires.
    """
    body = as_byte_tensor(buf)
    size = body.numel()
    if size < 8:
        raise WireFormatError(f"safetensors body is {size} bytes, shorter than its 8-byte length prefix")
    (header_len,) = struct.unpack("<Q", body[:8].numpy().tobytes())
    if header_len > max_header_bytes:
        raise WireFormatError(
            f"safetensors header of {header_len} bytes exceeds the {max_header_bytes} limit"
        )
    if 8 + header_len > size:
        raise WireFormatError(f"safetensors header claims {header_len} bytes but the body has {size - 8}")
    header = _parse_header(body[8 : 8 + header_len].numpy().tobytes())
    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise WireFormatError("safetensors __metadata__ must map strings to strings")
    if len(header) > max_tensors:
        raise WireFormatError(
            f"safetensors body holds {len(header)} tensors, more than the {max_tensors} limit"
        )
    data_start = 8 + header_len
    data_size = size - data_start
    spans: list[tuple[int, int, str]] = []
    layouts: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WireFormatError(f"tensor {name!r}: entry must have exactly dtype, shape and data_offsets")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise WireFormatError(f"tensor {name!r}: unsupported dtype {entry['dtype']!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d) for d in shape):
            raise WireFormatError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
            raise WireFormatError(f"tensor {name!r}: data_offsets must be two integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise WireFormatError(
                f"tensor {name!r}: data_offsets {offsets} outside the {data_size}-byte data"
            )
        expected = checked_nbytes(shape, dtype.itemsize, f"tensor {name!r}")
        if end - begin != expected:
            raise WireFormatError(
                f"tensor {name!r}: {end - begin} bytes for shape {shape}, expected {expected}"
            )
        spans.append((begin, end, name))
        layouts[name] = (dtype, shape, begin, end)
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise WireFormatError(f"tensor {name!r} starts at {begin}, expected {covered} (gap or overlap)")
        covered = end
    if covered != data_size:
        raise WireFormatError(
            f"safetensors data has {data_size - covered} trailing bytes not owned by any tensor"
        )
    tensors = {
        name: tensor_at(body, data_start + begin, end - begin, dtype, shape)
        for name, (dtype, shape, begin, end) in layouts.items()
    }
    return tensors, metadata
