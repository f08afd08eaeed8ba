"""Exporter throughput: `eagle3-target export` against a real server next to the in-process forward alone.

    .venv/bin/python -m bench.export [--quick] [--device cpu|cuda] [--rounds 2]

Writes a random Llama-style model in bf16 (hidden 512, 8 layers, vocab 32000; --quick: hidden 256, vocab
8000), pre-tokenised rows of 128-384 tokens (--quick: 64-256), starts a real `eagle3-target serve` (HF
engine) on a loopback port, and prints one JSON object with, per layout (speculators, specforge):
- inprocess_tokens_per_s: the HF runner's forward (`forward_hidden`, pre- or post-norm as the layout needs)
  in this process, on the very requests the exporter sends (same packing, same padding), nothing written;
- export_tokens_per_s: the whole export (scan, requests over HTTP with prefetch, decode, one file per
  row written, synced and renamed), from the exporter's own summary;
- ratio: export over in-process (goal >= 0.9);
- bytes_per_token: file bytes written per token.
Each rate is the best of --rounds interleaved rounds (a fresh output directory each time).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from eagle3_target.client.target_client import TargetClient
from eagle3_target.integrations.exporter import export, pack, padded
from eagle3_target.integrations.layouts import SpecForgeLayout, SpeculatorsLayout
from eagle3_target.integrations.rows import JsonlRows
from eagle3_target.runners import load_runner
from eagle3_target.tiny import write_tiny_model

from support.server_process import start_server

FULL = {"hidden_size": 512, "num_layers": 8, "vocab_size": 32000, "rows": 32, "min_len": 128, "max_len": 384}
QUICK = {"hidden_size": 256, "num_layers": 8, "vocab_size": 8000, "rows": 48, "min_len": 64, "max_len": 256}
BATCH_TOKENS = 4096


def write_rows(path: Path, shape: dict[str, int]) -> int:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shape["min_len"], shape["max_len"] + 1, (shape["rows"],), generator=g).tolist()
    with path.open("w") as out:
        for n in lengths:
            ids = torch.randint(0, shape["vocab_size"], (n,), generator=g).tolist()
            out.write(json.dumps({"input_ids": ids, "loss_mask": [1] * n}) + "\n")
    return sum(lengths)


def inprocess_rate(runner, rows: Path, prenorm: bool, device: str) -> float:
    """The forward alone on the exporter's own requests, outputs brought to the CPU."""
    source = JsonlRows(rows)
    batches = [padded(batch) for batch in pack(source.rows([True] * len(source.scan())), BATCH_TOKENS)]
    tokens = sum(int(mask.sum()) for _, mask in batches)
    with torch.inference_mode():
        runner.forward_hidden(batches[0][0][:1].to(device), prenorm=prenorm)  # warm-up
        started = time.perf_counter()
        for ids, mask in batches:
            final, aux = runner.forward_hidden(ids.to(device), mask.to(device), prenorm=prenorm)
            final.cpu(), aux.cpu()
        return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and shorter rows")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best counts")
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_tiny_model(
            tmp / "model",
            num_layers=shape["num_layers"],
            hidden_size=shape["hidden_size"],
            vocab_size=shape["vocab_size"],
            dtype="bfloat16",
        )
        rows = tmp / "rows.jsonl"
        total_tokens = write_rows(rows, shape)
        serve_args = ["--model", str(model_dir), "--engine", "hf", "--dtype", "bfloat16"]
        serve_args += ["--max-batch-tokens", str(BATCH_TOKENS), "--log-level", "WARNING"]
        server = start_server(tmp, serve_args, wait_ready=False, gpus=args.device == "cuda")
        try:
            runner = load_runner("hf", model_dir, dtype="bfloat16", device=args.device)
            server.wait_until("/readyz", 200, timeout=600)
            results = {}
            # bf16 forwards of a full request take minutes on a loaded CPU, past the client's default timeout.
            with TargetClient(server.url, timeout_s=1800) as client:
                for layout in (SpeculatorsLayout(), SpecForgeLayout()):
                    prenorm = layout.format == "hidden_prenorm"
                    local = exported = 0.0
                    nbytes = 0
                    for round_ in range(args.rounds):
                        local = max(local, inprocess_rate(runner, rows, prenorm, args.device))
                        out = tmp / f"{layout.name}-{round_}"
                        summary = export(client, JsonlRows(rows), layout, out, progress=False)
                        exported = max(exported, summary.tokens_per_s)
                        nbytes = summary.bytes_written
                    results[layout.name] = {
                        "inprocess_tokens_per_s": round(local, 1),
                        "export_tokens_per_s": round(exported, 1),
                        "ratio": round(exported / local, 3),
                        "bytes_per_token": round(nbytes / total_tokens, 1),
                    }
        finally:
            server.stop()
    print(
        json.dumps(
            {
                "bench": "export",
                "device": args.device,
                "model": {k: shape[k] for k in ("hidden_size", "num_layers", "vocab_size")},
                "rows": shape["rows"],
                "tokens": total_tokens,
                "batch_tokens": BATCH_TOKENS,
                "rounds": args.rounds,
                "torch_threads": torch.get_num_threads(),
                "layouts": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
