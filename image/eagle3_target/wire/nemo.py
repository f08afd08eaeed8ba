"""NeMo AutoModel's remote-target wire format, so NeMo's own client talks to our server unchanged.

Little-endian: u32 magic 0x4E4D4554 ("NMET"), then per entry u32 key_len, the UTF-8 key, u8 flags (bit 0:
the value is None) and, unless None, u8 dtype code, u8 ndim, ndim x i64 shape, u64 nbytes, the raw bytes.
The format has no entry count, so the body ends exactly where the last entry ends.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

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

MAGIC = 0x4E4D4554
DTYPE_CODES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.float64,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.int64,
    5: torch.int32,
    6: torch.int16,
    7: torch.int8,
    8: torch.uint8,
    9: torch.bool,
}
_CODES = {dtype: code for code, dtype in DTYPE_CODES.items()}
_FLAG_NONE = 0x01
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
_U64 = struct.Struct("<Q")


def encode(tensors: Mapping[str, Tensor | None]) -> bytes:
    """Serialize in NeMo's format in one buffer (small bodies: requests, tests)."""
    return encode_payload(tensors).tobytes()


def encode_payload(tensors: Mapping[str, Tensor | None]) -> Payload:
    """NeMo's body as segments: each entry's small framing, then the tensor's own bytes (moved to CPU)."""
    parts: list[bytes | memoryview] = [_U32.pack(MAGIC)]
    for key, t in tensors.items():
        key_bytes = key.encode("utf-8")
        parts.append(_U32.pack(len(key_bytes)) + key_bytes)
        if t is None:
            parts.append(_U8.pack(_FLAG_NONE))
            continue
        code = _CODES.get(t.dtype)
        if code is None:
            raise ValueError(f"tensor {key!r}: dtype {t.dtype} has no NeMo wire code")
        if t.dim() > 255:
            raise ValueError(f"tensor {key!r}: {t.dim()} dimensions exceed the format's 255")
        data = raw_bytes(t)
        parts.append(struct.pack(f"<BBB{t.dim()}qQ", 0, code, t.dim(), *t.shape, data.nbytes))
        parts.append(data)
    return Payload.of(parts)


class _Reader:
    """Bounds-checked cursor over the body; every read names what was truncated."""

    def __init__(self, body: Tensor) -> None:
        self.body = body
        self.raw = body.numpy().data if body.numel() else memoryview(b"")
        self.pos = 0

    def remaining(self) -> int:
        return len(self.raw) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.remaining():
            raise WireFormatError(
                f"NeMo wire body truncated in {what}: need {n} bytes, {self.remaining()} left"
            )
        chunk = self.raw[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: struct.Struct, what: str) -> int:
        return fmt.unpack(self.take(fmt.size, what))[0]


def decode(
    buf: bytes | bytearray | memoryview, *, max_total_bytes: int | None = None
) -> dict[str, Tensor | None]:
    """Parse a NeMo wire body strictly; tensors are views of the body (see `as_byte_tensor`)."""
    size = memoryview(buf).nbytes
    if max_total_bytes is not None and size > max_total_bytes:
        raise WireFormatError(f"NeMo wire body of {size} bytes exceeds the {max_total_bytes}-byte limit")
    reader = _Reader(as_byte_tensor(buf))
    magic = reader.unpack(_U32, "the magic")
    if magic != MAGIC:
        raise WireFormatError(f"not a NeMo wire body: magic 0x{magic:08x}, expected 0x{MAGIC:08x}")
    result: dict[str, Tensor | None] = {}
    while reader.remaining():
        key_len = reader.unpack(_U32, "a key length")
        try:
            key = bytes(reader.take(key_len, "a key")).decode("utf-8")
        except UnicodeDecodeError:
            raise WireFormatError("NeMo wire key is not valid UTF-8") from None
        if key in result:
            raise WireFormatError(f"NeMo wire body repeats key {key!r}")
        flags = reader.unpack(_U8, f"the flags of {key!r}")
        if flags == _FLAG_NONE:
            result[key] = None
            continue
        if flags != 0:
            raise WireFormatError(f"entry {key!r}: unknown flags 0x{flags:02x}")
        code = reader.unpack(_U8, f"the dtype of {key!r}")
        dtype = DTYPE_CODES.get(code)
        if dtype is None:
            raise WireFormatError(f"entry {key!r}: unknown dtype code {code}")
        ndim = reader.unpack(_U8, f"the rank of {key!r}")
        shape = list(struct.unpack(f"<{ndim}q", reader.take(8 * ndim, f"the shape of {key!r}")))
        expected = checked_nbytes(shape, dtype.itemsize, f"entry {key!r}")
        nbytes = reader.unpack(_U64, f"the byte count of {key!r}")
        if nbytes != expected:
            raise WireFormatError(
                f"entry {key!r}: {nbytes} bytes for shape {shape} of {dtype}, expected {expected}"
            )
        start = reader.pos
        reader.take(nbytes, f"the data of {key!r}")
        result[key] = tensor_at(reader.body, start, nbytes, dtype, shape)
    return result
