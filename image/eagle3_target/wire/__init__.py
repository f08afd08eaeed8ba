"""Wire codecs for tensors over HTTP: safetensors (the native API) and NeMo's remote-target format.

Both encoders produce a `Payload`: the body as its segments (a few bytes of framing, then each tensor's
own memory), so a server streams a body without ever joining it. Both decoders treat the body as
untrusted: every length and shape is checked against the bytes actually present before anything is
allocated, and a malformed body raises `WireFormatError` (a ValueError) with a message the server can
return as a 400.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class WireFormatError(ValueError):
    """A body that is not a well-formed payload of the expected wire format."""


def as_byte_tensor(buf: bytes | bytearray | memoryview) -> Tensor:
    """A flat uint8 tensor over the body: shared for writable buffers, one copy for read-only ones.

    Decoded tensors are views of this tensor, so a writable body (bytearray) is decoded without copying;
    an immutable `bytes` body is copied once so that callers get ordinary writable tensors.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        # numpy's copy is several times faster than bytearray(view): it allocates with huge pages.
        return torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())
    return torch.frombuffer(view, dtype=torch.uint8)


def tensor_at(body: Tensor, start: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    """The tensor stored in body[start:start+nbytes]; a view unless the bytes are misaligned for dtype."""
    if nbytes == 0:
        try:
            return torch.empty(tuple(shape), dtype=dtype)
        except RuntimeError as exc:  # e.g. a zero dim beside dims whose product overflows int64
            raise WireFormatError(f"cannot build an empty tensor of shape {list(shape)}: {exc}") from None
    raw = body[start : start + nbytes]
    if dtype == torch.bool and int(raw.max()) > 1:
        # A C++ bool holding another byte is undefined behaviour in torch's kernels: refuse it here.
        raise WireFormatError("a bool tensor holds bytes other than 0 and 1")
    itemsize = dtype.itemsize
    if raw.storage_offset() % itemsize or raw.data_ptr() % itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(tuple(shape))


def checked_nbytes(shape: Sequence[int], itemsize: int, what: str) -> int:
    """prod(shape) * itemsize in exact integers, refusing dims a tensor cannot have."""
    for dim in shape:
        if dim < 0 or dim >= 2**63:
            raise WireFormatError(f"{what}: invalid dimension {dim} in shape {list(shape)}")
    return math.prod(shape) * itemsize


def raw_bytes(t: Tensor) -> memoryview:
    """The contiguous CPU bytes of a tensor, as a flat byte memoryview (no copy when already contiguous on
    CPU). The view keeps the tensor's storage alive."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


@dataclass(frozen=True)
class Payload:
    """An encoded body as the byte segments it is made of, in order, never joined on the server.

    Framing segments are small `bytes`; data segments are views of the tensors' own memory, so the body
    costs no memory beyond the tensors and can be written to a socket piece by piece.
    """

    segments: tuple[memoryview, ...]

    @classmethod
    def of(cls, parts: Sequence[bytes | memoryview]) -> Payload:
        return cls(tuple(memoryview(part).cast("B") for part in parts if len(part)))

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)

    def chunks(self, size: int) -> Iterator[memoryview]:
        """The body in pieces of at most ``size`` bytes, each a view (no copy)."""
        for segment in self.segments:
            for start in range(0, segment.nbytes, size):
                yield segment[start : start + size]

    def tobytes(self) -> bytes:
        """The whole body in one buffer (one copy): for request bodies and tests, not for responses."""
        return b"".join(self.segments)
