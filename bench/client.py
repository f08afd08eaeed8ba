"""Client-side supervision throughput and wire cost: prints one JSON object.

Starts `eagle3-target serve` (HF engine, CPU) on a loopback port with a tiny bf16 model shaped like a large
target in the ratios that matter (draft vocab / hidden = 8, as Llama-3.1-8B with a 32k draft vocab), then
pulls the same batches through TargetClient for the `hidden` and `probs` formats, sequentially and with
prefetch. Bytes/token are what came over the wire; `exact` checks both formats rebuild the same batch.

    python -m bench.client [--batches 16] [--batch-size 4] [--seq-len 256] [--depth 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from eagle3_target.client import TargetClient
from eagle3_target.contract import VocabMapping
from eagle3_target.tiny import write_tiny_model

from support.server_process import start_server

HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 128, 4096, 1024, 8


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, attention_mask, loss_mask


def measure(url: str, batches: list[Batch], fmt: str, mapping: VocabMapping, depth: int) -> dict[str, float]:
    """Tokens/s and bytes/token for one format, fetched one at a time (depth 0) or with prefetch."""
    tokens = sum(b[0].numel() for b in batches)
    with TargetClient(url) as client:
        client.batch(*batches[0], format=fmt, mapping=mapping)  # warm up: connection, lm_head, vocab
        warm_bytes = client.stats["bytes_received"]
        started = time.perf_counter()
        if depth == 0:
            for batch in batches:
                client.batch(*batch, format=fmt, mapping=mapping)
        else:
            for _ in client.prefetch(batches, format=fmt, mapping=mapping, depth=depth):
                pass
        elapsed = time.perf_counter() - started
        wire = client.stats["bytes_received"] - warm_bytes
    return {"tokens_per_s": round(tokens / elapsed, 1), "bytes_per_token": round(wire / tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the server gets the other core(s)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch_size, args.seq_len)
    batches = [
        (
            torch.randint(0, VOCAB, shape, generator=g),
            torch.ones(shape, dtype=torch.int64),
            torch.ones(shape, dtype=torch.int64),
        )
        for _ in range(args.batches)
    ]
    mapping = VocabMapping.from_selected_ids(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB], VOCAB)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(
            Path(tmp) / "model", num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, dtype="bfloat16"
        )
        server = start_server(Path(tmp), ["--model", str(model), "--engine", "hf", "--dtype", "bfloat16"])
        url = server.url
        try:
            results: dict[str, dict] = {}
            for fmt in ("hidden", "probs"):
                results[fmt] = {
                    "sequential": measure(url, batches, fmt, mapping, depth=0),
                    f"prefetch_depth_{args.depth}": measure(url, batches, fmt, mapping, depth=args.depth),
                }
            with TargetClient(url) as client:
                from_hidden = client.batch(*batches[0], format="hidden", mapping=mapping)
                from_probs = client.batch(*batches[0], format="probs", mapping=mapping)
            assert from_hidden.target_probs is not None and from_probs.target_probs is not None  # a mapping
            assert from_hidden.position_mask is not None and from_probs.position_mask is not None
            exact = torch.equal(from_hidden.target_probs, from_probs.target_probs) and torch.equal(
                from_hidden.position_mask, from_probs.position_mask
            )
        finally:
            server.stop()
    seq = f"prefetch_depth_{args.depth}"
    print(
        json.dumps(
            {
                "model": {
                    "hidden": HIDDEN,
                    "vocab": VOCAB,
                    "draft_vocab": DRAFT_VOCAB,
                    "layers": LAYERS,
                    "dtype": "bfloat16",
                },
                "tokens_per_batch": args.batch_size * args.seq_len,
                "batches": args.batches,
                "formats": results,
                "probs_over_hidden_bytes": round(
                    results["probs"][seq]["bytes_per_token"] / results["hidden"][seq]["bytes_per_token"], 2
                ),
                "hidden_and_probs_batches_identical": exact,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
