"""Draft training throughput: examples/train_draft.py against a served target next to the target in-process.

    .venv/bin/python -m bench.train [--quick] [--rounds 3] [--steps 8] [--dtype float32|bfloat16]
        [--server-threads 1] [--trainer-threads 2] [--inprocess-threads 2] [--depth 2] [--format hidden]

Writes a random Llama-style target (hidden 512, 8 layers, vocab 8000, fp32; --quick: hidden 256) and trains
the same fresh EAGLE-3 draft (`examples.train_draft.DraftRun`: same seed, corpus, draft vocabulary of a
quarter of the target's, 3 unrolled steps) on the same batches of 4 x 256 tokens (--quick: 4 x 128) two
ways, on the CPU:
- served: a real `eagle3-target serve` (HF engine) on a loopback port, its supervision pulled through
  `TargetClient.prefetch` (`--depth` requests ahead, `--format`), the draft step in this process;
- in-process: the trainer runs the target itself, NeMo's co-located HF backend (`runner.forward_eagle3`
  then `contract.build_batch`), one forward then one draft step, nothing overlapped.
The machine's cores are shared explicitly and recorded (torch_threads, server_env): the server process runs
--server-threads torch threads (OMP_NUM_THREADS / MKL_NUM_THREADS in its environment; default half the
cores), this process `torch.set_num_threads(--trainer-threads)` while it trains against the server and
--inprocess-threads while it runs the target and the draft itself (both default: every core). The target is
about 40% of an in-process step here, so by default its forward runs on one thread in the server beside the
draft step on all of them; one core each (--trainer-threads 1) leaves the draft's core the bottleneck.

Prints one JSON object: inprocess_tokens_per_s, served_tokens_per_s, ratio (served over in-process, goal
>= 0.9), inprocess_target_share (the share of an in-process step spent in the target), loss_max_abs_diff
(the two runs' per-step losses, which should agree), every round's rates (*_rounds), the threads each
process ran and the settings, and the machine's load average before and after (on a loaded machine
multi-threaded steps slow down several times and the ratio says little). Each rate is the best of --rounds
interleaved rounds, each a fresh draft trained for --steps timed steps after 2 untimed ones, so load from
other processes on a shared machine skews neither path more.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from eagle3_target.client import TargetClient
from eagle3_target.contract import Eagle3TargetBatch, VocabMapping, build_batch
from eagle3_target.runners import TargetRunner, load_runner
from eagle3_target.tiny import write_tiny_model
from torch import Tensor

from examples.train_draft import DraftRun
from support.server_process import start_server

FULL = {"hidden_size": 512, "num_layers": 8, "vocab_size": 8000, "batch_size": 4, "seq_len": 256}
# 8 layers is the shallowest depth the default aux-layer recipe accepts.
QUICK = {"hidden_size": 256, "num_layers": 8, "vocab_size": 8000, "batch_size": 4, "seq_len": 128}
CORPUS_ROWS = 32
TTT_STEPS = 3
WARMUP_STEPS = 2
SEED = 0

Batch = tuple[Tensor, Tensor, Tensor]  # input_ids, attention_mask, loss_mask


def inprocess_batches(
    runner: TargetRunner, batches: Sequence[Batch], mapping: VocabMapping, target_seconds: list[float]
) -> Iterator[Eagle3TargetBatch]:
    """The co-located HF backend's batches: the runner's logits and aux, then the contract's shift and
    projection; the time spent here is added to `target_seconds[0]`."""
    for input_ids, attention_mask, loss_mask in batches:
        started = time.perf_counter()
        logits, aux = runner.forward_eagle3(input_ids, attention_mask)
        batch = build_batch(logits, aux, input_ids, attention_mask, loss_mask, mapping=mapping)
        target_seconds[0] += time.perf_counter() - started
        yield batch


def timed_steps(
    run: DraftRun, batches: Iterator[Eagle3TargetBatch], tokens_per_step: int
) -> tuple[float, list[float]]:
    """(tokens/s over the steps after the warm-up ones, every step's loss); consumes `batches`."""
    losses = [run.step(next(batches), TTT_STEPS)["loss"] for _ in range(WARMUP_STEPS)]
    started = time.perf_counter()
    steps = 0
    for batch in batches:
        losses.append(run.step(batch, TTT_STEPS)["loss"])
        steps += 1
    return steps * tokens_per_step / (time.perf_counter() - started), losses


def start_run(vocab_size: int, embeddings: Tensor, shape: dict[str, int]) -> DraftRun:
    return DraftRun.start(
        vocab_size,
        embeddings,
        seq_len=shape["seq_len"],
        corpus_rows=CORPUS_ROWS,
        draft_vocab_size=vocab_size // 4,
        seed=SEED,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller target and shorter rows")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    parser.add_argument("--steps", type=int, default=8, help="timed draft steps per round and path")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's")
    parser.add_argument("--format", choices=["hidden", "draft", "probs"], default="hidden")
    parser.add_argument("--depth", type=int, default=2, help="TargetClient.prefetch depth")
    cores = os.cpu_count() or 1
    parser.add_argument("--server-threads", type=int, default=max(1, cores // 2), help="the server's")
    parser.add_argument("--trainer-threads", type=int, default=cores, help="this process's, served")
    parser.add_argument("--inprocess-threads", type=int, default=cores, help="this process's, in-process")
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    tokens_per_step = shape["batch_size"] * shape["seq_len"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_tiny_model(
            tmp / "model",
            num_layers=shape["num_layers"],
            hidden_size=shape["hidden_size"],
            vocab_size=shape["vocab_size"],
            dtype=args.dtype,
        )
        serve_args = ["--model", str(model_dir), "--engine", "hf", "--dtype", args.dtype]
        serve_args += ["--max-batch-tokens", str(2 * tokens_per_step), "--log-level", "WARNING"]
        threads = str(args.server_threads)
        server_env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        server = start_server(tmp, serve_args, env=server_env, wait_ready=False)
        try:
            runner = load_runner("hf", model_dir, dtype=args.dtype, device="cpu")
            vocab_size = shape["vocab_size"]
            steps = WARMUP_STEPS + args.steps
            server.wait_until("/readyz", 200, timeout=600)
            rates: dict[str, list[float]] = {"inprocess": [], "served": []}
            target_share = 0.0
            loss_diff = 0.0
            with TargetClient(server.url, timeout_s=1800) as client:
                for _ in range(args.rounds):
                    torch.set_num_threads(args.inprocess_threads)
                    run = start_run(vocab_size, runner.input_embedding_weight(), shape)
                    target_seconds = [0.0]
                    batches = run.text.batches(shape["batch_size"], steps, SEED)
                    started = time.perf_counter()
                    rate, local_losses = timed_steps(
                        run, inprocess_batches(runner, batches, run.mapping, target_seconds), tokens_per_step
                    )
                    if rate > max(rates["inprocess"], default=0.0):
                        target_share = target_seconds[0] / (time.perf_counter() - started)
                    rates["inprocess"].append(rate)

                    torch.set_num_threads(args.trainer_threads)
                    run = start_run(vocab_size, client.weight("input_embeddings"), shape)
                    batches = run.text.batches(shape["batch_size"], steps, SEED)
                    supervised = client.prefetch(
                        batches, format=args.format, mapping=run.mapping, depth=args.depth
                    )
                    rate, served_losses = timed_steps(run, supervised, tokens_per_step)
                    rates["served"].append(rate)
                    diffs = [abs(a - b) for a, b in zip(local_losses, served_losses, strict=True)]
                    loss_diff = max(loss_diff, *diffs)
        finally:
            server.stop()
    local, served = max(rates["inprocess"]), max(rates["served"])
    print(
        json.dumps(
            {
                "bench": "train",
                "device": "cpu",
                "model": {k: shape[k] for k in ("hidden_size", "num_layers", "vocab_size")}
                | {"dtype": args.dtype, "draft_vocab": shape["vocab_size"] // 4},
                "batch": [shape["batch_size"], shape["seq_len"]],
                "ttt_steps": TTT_STEPS,
                "steps_per_round": args.steps,
                "warmup_steps": WARMUP_STEPS,
                "rounds": args.rounds,
                "format": args.format,
                "prefetch_depth": args.depth,
                "cpu_cores": cores,
                "torch_threads": {
                    "inprocess": args.inprocess_threads,
                    "served_trainer": args.trainer_threads,
                    "server": args.server_threads,
                },
                "server_env": server_env,
                "inprocess_tokens_per_s": round(local, 1),
                "served_tokens_per_s": round(served, 1),
                "ratio": round(served / local, 3),
                "inprocess_target_share": round(target_share, 3),
                "loss_max_abs_diff": round(loss_diff, 6),
                **{f"{k}_rounds": [round(r, 1) for r in v] for k, v in rates.items()},
                "load_average": {
                    "before": [round(x, 2) for x in load_before],
                    "after": [round(x, 2) for x in os.getloadavg()],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
