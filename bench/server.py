"""Target server throughput: the HTTP path of every format next to the in-process runner, same inputs.

    .venv/bin/python -m bench.server [--quick] [--device cpu|cuda] [--reps 2] [--rounds 3]

Writes a random Llama-style model (hidden 1024, 8 layers, vocab 32000, fp32; --quick: hidden 256, 8 layers,
vocab 8000), starts a real `eagle3-target serve` (HF engine) on a loopback port and sends batches of
4 x 256 tokens (--quick: 2 x 128). Prints one JSON object with, per format:
- inprocess_tokens_per_s: runner.forward_hidden + formats.supervision in this process (what a co-located
  trainer pays), on the same batches;
- http_c1_tokens_per_s / http_c4_tokens_per_s: end to end over HTTP with 1 and 4 concurrent clients
  (encode, send, engine, response bytes received and decoded);
- ratio_c1 / ratio_c4: HTTP over in-process (goal >= 0.9 for hidden and draft);
- bytes_per_token: response body bytes on the wire per token.
Each rate is the best of --rounds interleaved rounds of --reps requests per client, so that load from
other processes on a shared machine skews neither path more than the other.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from eagle3_target import formats
from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import FORMATS
from eagle3_target.runners import load_runner
from eagle3_target.tiny import write_tiny_model
from eagle3_target.wire import tensors as tensor_wire

from support.server_process import start_server

FULL = {
    "hidden_size": 1024,
    "num_layers": 8,
    "vocab_size": 32000,
    "batch": 4,
    "seq": 256,
    "draft_vocab": 8192,
}
# 8 layers is the shallowest depth the default aux-layer recipe accepts.
QUICK = {"hidden_size": 256, "num_layers": 8, "vocab_size": 8000, "batch": 2, "seq": 128, "draft_vocab": 2048}


def inprocess_rate(runner, fmt: str, batches, mapping: VocabMapping | None, reps: int) -> float:
    lm_head = runner.lm_head_weight()

    def once(ids: torch.Tensor) -> None:
        with torch.inference_mode():
            final_hidden, aux = runner.forward_hidden(ids, torch.ones_like(ids))
            out = formats.supervision(fmt, final_hidden, aux, lm_head, mapping=mapping)
            for t in out.values():
                t.cpu()

    once(batches[0])  # warm-up
    started = time.perf_counter()
    for i in range(reps):
        once(batches[i % len(batches)])
    return reps * batches[0].numel() / (time.perf_counter() - started)


def http_rate(
    url: str, fmt: str, bodies: list[bytes], tokens: int, concurrency: int, reps: int
) -> tuple[float, int]:
    params = {"format": fmt} | ({"vocab": "bench"} if fmt in ("draft", "probs") else {})
    sizes: list[int] = []
    # Clients warm up, then all (and the clock) start together.
    barrier = threading.Barrier(concurrency + 1)
    errors: list[BaseException] = []

    def client(worker: int) -> None:
        try:
            with httpx.Client(timeout=600) as http:
                http.post(
                    url + "/v1/supervision", params=params, content=bodies[worker % len(bodies)]
                )  # warm-up
                barrier.wait()
                for i in range(reps):
                    response = http.post(
                        url + "/v1/supervision", params=params, content=bodies[(worker + i) % len(bodies)]
                    )
                    response.raise_for_status()
                    tensor_wire.decode(response.content)
                    sizes.append(len(response.content))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
            raise

    threads = [threading.Thread(target=client, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait(timeout=600)
    started = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    elapsed = time.perf_counter() - started
    return concurrency * reps * tokens / elapsed, sizes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and batch")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--reps", type=int, default=2, help="requests per client per measurement")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved measurement rounds; the best counts"
    )
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    reps = args.reps
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        model_dir = write_tiny_model(
            Path(tmp) / "model",
            num_layers=shape["num_layers"],
            hidden_size=shape["hidden_size"],
            vocab_size=shape["vocab_size"],
        )
        serve_args = ["--model", str(model_dir), "--engine", "hf", "--dtype", "float32"]
        serve_args += ["--max-batch-tokens", "8192", "--log-level", "WARNING"]
        gpus = args.device == "cuda"
        server = start_server(Path(tmp), serve_args, wait_ready=False, gpus=gpus)
        url = server.url
        try:
            runner = load_runner("hf", model_dir, dtype="float32", device=args.device)
            vocab = shape["vocab_size"]
            mapping = VocabMapping.from_selected_ids(torch.randperm(vocab)[: shape["draft_vocab"]], vocab)
            batches = [torch.randint(0, vocab, (shape["batch"], shape["seq"])) for _ in range(4)]
            bodies = [tensor_wire.encode({"input_ids": b}) for b in batches]
            tokens = batches[0].numel()
            server.wait_until("/readyz", 200, timeout=600)
            put = httpx.put(
                url + "/v1/vocab-mappings/bench",
                content=tensor_wire.encode({"selected_token_ids": mapping.selected_token_ids}),
            )
            put.raise_for_status()
            results = {}
            for fmt in FORMATS:
                fmt_mapping = mapping.to(args.device) if fmt in ("draft", "probs") else None
                # Interleaved rounds, best of each path: a shared machine's noise hits both paths alike.
                local, c1, c4 = 0.0, 0.0, 0.0
                for _ in range(args.rounds):
                    local = max(local, inprocess_rate(runner, fmt, batches, fmt_mapping, reps))
                    c1_rate, size = http_rate(url, fmt, bodies, tokens, 1, reps)
                    c1 = max(c1, c1_rate)
                    c4 = max(c4, http_rate(url, fmt, bodies, tokens, 4, reps)[0])
                results[fmt] = {
                    "inprocess_tokens_per_s": round(local, 1),
                    "http_c1_tokens_per_s": round(c1, 1),
                    "http_c4_tokens_per_s": round(c4, 1),
                    "ratio_c1": round(c1 / local, 3),
                    "ratio_c4": round(c4 / local, 3),
                    "bytes_per_token": round(size / tokens, 1),
                }
        finally:
            server.stop()
    print(
        json.dumps(
            {
                "bench": "server",
                "device": args.device,
                "model": {k: shape[k] for k in ("hidden_size", "num_layers", "vocab_size", "draft_vocab")},
                "batch": [shape["batch"], shape["seq"]],
                "reps_per_client": reps,
                "rounds": args.rounds,
                "torch_threads": torch.get_num_threads(),
                "formats": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
