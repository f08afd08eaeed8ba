"""The model fingerprint: stable for the same weights and options, changed by any of them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle3_target.server.fingerprint import model_fingerprint, sample_offsets, weight_file_digest


def test_sample_offsets_cover_the_file():
    assert sample_offsets(100) == [0]
    offsets = sample_offsets(1_000_000)
    assert offsets[0] == 0 and offsets[-1] == 1_000_000 - 4096 and len(offsets) == 4


def test_fingerprint_is_stable_and_sensitive(tiny_llama_dir: Path, tmp_path: Path):
    def fingerprint(path: Path, **overrides) -> str:
        args = {
            "model_name": "m",
            "revision": "r",
            "dtype": "float32",
            "engine": "hf",
            "aux_layer_ids": [1, 3, 4],
            "capture_layer_ids": [1, 3, 4],
        }
        return model_fingerprint(str(path), **(args | overrides))

    base = fingerprint(tiny_llama_dir)
    assert base.startswith("sha256:") and base == fingerprint(tiny_llama_dir)
    for change in (
        {"revision": "r2"},
        {"dtype": "bfloat16"},
        {"engine": "vllm"},
        {"aux_layer_ids": [1, 3, 5], "capture_layer_ids": [1, 3, 5]},
        {"capture_layer_ids": [1, 3, 4, 7]},
        {"capture_layer_ids": [4, 3, 1]},
    ):
        assert fingerprint(tiny_llama_dir, **change) != base
    # A target capturing only its aux layers keeps the fingerprint of the servers before capture sets, so
    # an upgrade does not break its clients' pins: the identity document has no capture set then.
    identity = {
        "model": "m",
        "revision": "r",
        "dtype": "float32",
        "engine": "hf",
        "aux_layer_ids": [1, 3, 4],
        "weights": {p.name: weight_file_digest(p) for p in sorted(tiny_llama_dir.glob("*.safetensors"))},
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    assert base == "sha256:" + hashlib.sha256(canonical).hexdigest()
    # The same weights elsewhere are the same model.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_llama_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert fingerprint(copy) == base
    # A changed byte inside a sampled region (the file's start: the safetensors header) changes it.
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    before = weight_file_digest(shard)
    data[-1] ^= 0xFF  # the last sample always ends at the file's end
    shard.write_bytes(bytes(data))
    assert weight_file_digest(shard) != before
    assert fingerprint(copy) != base
