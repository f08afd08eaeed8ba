"""Wire codec throughput and supervision bytes per token; prints one JSON object.

    .venv/bin/python -m bench.wire [--mib 64] [--repeats 5]

Throughputs are relative to a plain memory copy of the same payload (into a preallocated buffer, the
strictest baseline) measured in the same run, so the ratios travel across machines. Bytes/token at
Llama-3.1-8B sizes are computed from the format definitions; at a tiny model they are measured by encoding
real supervision (the two must agree, header aside).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable

import safetensors.torch
import torch
from eagle3_target.contract import VocabMapping
from eagle3_target.formats import supervision
from eagle3_target.protocol import FORMATS
from eagle3_target.runners.hf import HFRunner
from eagle3_target.tiny import write_tiny_model
from eagle3_target.wire import nemo, tensors

from support.supervision import bytes_per_token


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up (page faults, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def codec_throughput(mib: int, repeats: int) -> dict[str, float]:
    numel = mib * 1024 * 1024 // 2
    # A realistic body: mostly bf16 aux, plus ids and masks.
    payload = {
        "aux_hidden_states": torch.randn(numel - 4096, dtype=torch.float32).to(torch.bfloat16),
        "input_ids": torch.arange(1024, dtype=torch.int64),
        "position_mask": torch.ones(4096, dtype=torch.bool),
    }
    size = sum(t.numel() * t.element_size() for t in payload.values())
    src = torch.empty(size, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    memcpy = best_seconds(lambda: dst.copy_(src), repeats)
    st_body = tensors.encode(payload)
    st_writable = bytearray(st_body)
    nemo_body = nemo.encode(payload)
    timings = {
        "safetensors_encode": best_seconds(lambda: tensors.encode(payload), repeats),
        "safetensors_decode_bytes": best_seconds(lambda: tensors.decode(st_body), repeats),
        "safetensors_decode_bytearray": best_seconds(lambda: tensors.decode(st_writable), repeats),
        "nemo_encode": best_seconds(lambda: nemo.encode(payload), repeats),
        "nemo_decode_bytes": best_seconds(lambda: nemo.decode(nemo_body), repeats),
        "safetensors_library_save": best_seconds(lambda: safetensors.torch.save(payload), repeats),
        "safetensors_library_load": best_seconds(lambda: safetensors.torch.load(st_body), repeats),
    }
    result: dict[str, float] = {"payload_mib": size / 2**20, "memcpy_gbps": size / memcpy / 1e9}
    for name, seconds in timings.items():
        result[f"{name}_gbps"] = round(size / seconds / 1e9, 2)
        result[f"{name}_vs_memcpy"] = round(memcpy / seconds, 3)
    result["memcpy_gbps"] = round(result["memcpy_gbps"], 2)
    return result


def tiny_bytes_per_token() -> dict[str, dict[str, float]]:
    hidden, vocab, draft_vocab, batch, seq = 64, 256, 128, 4, 64
    with tempfile.TemporaryDirectory() as tmp:
        runner = HFRunner.from_pretrained(
            write_tiny_model(tmp, hidden_size=hidden, vocab_size=vocab), dtype="float32", device="cpu"
        )
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        final, aux = runner.forward_hidden(ids)
        mapping = VocabMapping.from_selected_ids(torch.randperm(vocab)[:draft_vocab], vocab)
        out = {}
        for fmt in FORMATS:
            body = tensors.encode(supervision(fmt, final, aux, runner.lm_head_weight(), mapping=mapping))
            out[fmt] = {
                "measured": round(len(body) / (batch * seq), 1),
                "computed": bytes_per_token(
                    fmt, hidden=hidden, vocab=vocab, draft_vocab=draft_vocab, itemsize=4
                ),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llama = {"hidden": 4096, "vocab": 128256, "draft_vocab": 32000, "itemsize": 2}
    report = {
        "torch_threads": torch.get_num_threads(),
        "codecs": codec_throughput(args.mib, args.repeats),
        "bytes_per_token_llama31_8b_bf16": {fmt: bytes_per_token(fmt, **llama) for fmt in FORMATS},
        "bytes_per_token_tiny_fp32_h64_v256_vd128": tiny_bytes_per_token(),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
