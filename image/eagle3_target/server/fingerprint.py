"""A stable fingerprint of what a server serves: model identity, serving options and the weights.

Hashing every weight byte would read tens of GB at start-up. Instead each weight file contributes its name,
size, safetensors header (every tensor's name, dtype, shape and offsets) and a few fixed-position content
samples. Any re-export, re-quantisation or shape change alters the headers or sizes; the samples catch
same-shape retrains.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 4
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def safetensors_header(path: Path) -> bytes | None:
    """The raw JSON header of a safetensors file, or None when the file is not one."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return None
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
            return None
        return f.read(length)


def sample_offsets(size: int, count: int = SAMPLES_PER_FILE, width: int = SAMPLE_BYTES) -> list[int]:
    """``count`` evenly spread offsets at which a ``width``-byte sample fits inside ``size`` bytes."""
    if size <= width:
        return [0]
    last = size - width
    return sorted({last * i // (count - 1) for i in range(count)})


def weight_file_digest(path: Path) -> str:
    """SHA-256 over a file's size, safetensors header and content samples."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    h.update(safetensors_header(path) or b"")
    with path.open("rb") as f:
        for offset in sample_offsets(size):
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a local model directory, in a stable order."""
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def model_fingerprint(
    model_path: str,
    *,
    model_name: str,
    revision: str | None,
    dtype: str,
    engine: str,
    aux_layer_ids: Sequence[int],
    capture_layer_ids: Sequence[int],
) -> str:
    """``sha256:<hex>`` identifying the served model; equal across replicas serving the same thing.

    The engine is included because vLLM and HF agree only to numerical tolerance, so a trainer should not
    silently mix them. The local path is not included: two replicas may mount the same weights elsewhere.
    A capture set beyond the aux layers is included only when set, so a target that captures just its aux
    layers keeps the fingerprint it had before capture sets existed (its clients' pins still hold).
    """
    root = Path(model_path)
    files = weight_files(root) if root.is_dir() else ([root] if root.is_file() else [])
    base = root if root.is_dir() else root.parent
    identity = {
        "model": model_name,
        "revision": revision,
        "dtype": dtype,
        "engine": engine,
        "aux_layer_ids": list(aux_layer_ids),
        "weights": {str(p.relative_to(base)): weight_file_digest(p) for p in files},
    }
    if list(capture_layer_ids) != list(aux_layer_ids):
        identity["capture_layer_ids"] = list(capture_layer_ids)
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()
