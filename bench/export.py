"""Exporter throughput: `eagle3-target export` against a real server next to the in-process forward alone.

    .venv/bin/python -m bench.export [--quick] [--device cpu|cuda] [--rounds 3] [--rows 256]
        [--server-threads 1] [--inprocess-threads 1] [--exporter-threads 1]

Writes a random Llama-style model in bf16 (hidden 512, 8 layers, vocab 32000; --quick: hidden 256, vocab
8000), --rows pre-tokenised rows of 128-384 tokens (--quick: 64-256), starts a real `eagle3-target serve`
(HF engine) on a loopback port, and prints one JSON object with, per layout (speculators, specforge):
- inprocess_tokens_per_s: the HF runner's forward (`forward_hidden`, pre- or post-norm as the layout needs)
  in this process, on the very requests the exporter sends (same packing, same padding), nothing written;
- export_tokens_per_s: the whole export (scan, requests over HTTP with prefetch, decode, one file per
  row written, synced and renamed), from the exporter's own summary;
- ratio: export over in-process (goal >= 0.9);
- inprocess_export_tokens_per_s and ratio_vs_inprocess_export: the same `export()` with the runner in this
  process in place of the server (same files, same syncs), so what serving costs is apart from what
  writing the files costs;
- bytes_per_token: file bytes written per token; requests: requests per export;
- *_rounds: every round's rate, to show how much the machine's load moved them.
Each rate is the best of --rounds interleaved rounds (a fresh output directory each time), after one warm-up
request per path. The cores are shared explicitly and recorded (torch_threads, server_env): the target gets
the same cores on both paths, --inprocess-threads torch threads here and --server-threads in the server
(OMP_NUM_THREADS / MKL_NUM_THREADS in its environment), by default half the machine, which leaves the other
half to the exporter's own work (decode, copies, file writes and syncs; this process runs --exporter-threads
torch threads while it exports). Give the target every core (--server-threads 2 --inprocess-threads 2 on 2
cores) and the exporter's work competes with the server's forward for them: the ratio then also counts what
writing the files costs on a machine the forward already fills, which ratio_vs_inprocess_export pays too. The
rows default to 256, so an export is many requests, as a real one is, not mostly a pipeline's fill and drain
(32-48 rows were 3 requests). load_average is the machine's before and after: on a loaded machine the
multi-threaded forward slows down several times on both paths and the ratio says little about the exporter.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from eagle3_target.client.target_client import TargetClient
from eagle3_target.contract import select_layers
from eagle3_target.integrations.exporter import export, pack, padded
from eagle3_target.integrations.layouts import Layout, SpecForgeLayout, SpeculatorsLayout
from eagle3_target.integrations.rows import JsonlRows
from eagle3_target.protocol import FINAL_STATES, FORMATS, FinalState, TargetInfo
from eagle3_target.runners import TargetRunner, load_runner
from eagle3_target.tiny import write_tiny_model
from torch import Tensor

from support.server_process import start_server

FULL = {"hidden_size": 512, "num_layers": 8, "vocab_size": 32000, "min_len": 128, "max_len": 384}
QUICK = {"hidden_size": 256, "num_layers": 8, "vocab_size": 8000, "min_len": 64, "max_len": 256}
BATCH_TOKENS = 4096


def write_rows(path: Path, shape: dict[str, int], rows: int) -> int:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shape["min_len"], shape["max_len"] + 1, (rows,), generator=g).tolist()
    with path.open("w") as out:
        for n in lengths:
            ids = torch.randint(0, shape["vocab_size"], (n,), generator=g).tolist()
            out.write(json.dumps({"input_ids": ids, "loss_mask": [1] * n}) + "\n")
    return sum(lengths)


def inprocess_rate(runner: TargetRunner, rows: Path, prenorm: bool, device: str) -> float:
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


class InProcessTarget:
    """What `export()` uses of a `TargetClient` (info, supervise, stats), answered by a runner in this
    process: the exporter's files, syncs and overlap, without the server."""

    def __init__(self, runner: TargetRunner, info: TargetInfo, device: str) -> None:
        self.runner, self._info, self.device = runner, info, device
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()  # runners are not re-entrant; the exporter fetches from 2 threads

    def info(self) -> TargetInfo:
        return self._info

    def supervise(self, input_ids: Tensor, attention_mask: Tensor, format: str) -> dict[str, Tensor]:
        prenorm = FORMATS[format].prenorm
        with self._lock, torch.inference_mode():
            final, aux = self.runner.forward_hidden(
                input_ids.to(self.device), attention_mask.to(self.device), prenorm=prenorm
            )
            self.stats["requests"] += 1
            return {"aux_hidden_states": aux.cpu(), FORMATS[format].tensors[1]: final.cpu()}

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None, layers: Sequence[int], final: FinalState
    ) -> dict[str, Tensor]:
        """The `layers` format (what the speculators layout asks for), from the runner's capture set."""
        with self._lock, torch.inference_mode():
            last, captured = self.runner.forward_hidden(
                input_ids.to(self.device),
                None if attention_mask is None else attention_mask.to(self.device),
                prenorm=final == "prenorm",
            )
            self.stats["requests"] += 1
            out = {"hidden_states": select_layers(captured, self.runner.capture_layer_ids, layers).cpu()}
            return out | {name: last.cpu() for name in [FINAL_STATES[final]] if name is not None}


def exported_rate(
    target: TargetClient | InProcessTarget, rows: Path, layout: Layout, out: Path
) -> tuple[float, int, int]:
    """(tokens/s, bytes written, requests) of one export into the fresh directory `out`."""
    # export() calls only info() and supervise() and reads stats, which InProcessTarget provides.
    summary = export(cast(TargetClient, target), JsonlRows(rows), layout, out, progress=False)
    return summary.tokens_per_s, summary.bytes_written, summary.requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and shorter rows")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    parser.add_argument("--rows", type=int, default=256, help="rows exported per round")
    cores = os.cpu_count() or 1
    target_threads = max(1, cores // 2)
    parser.add_argument(
        "--server-threads", type=int, default=target_threads, help="the server's torch threads"
    )
    parser.add_argument(
        "--inprocess-threads", type=int, default=target_threads, help="the in-process target's"
    )
    parser.add_argument(
        "--exporter-threads", type=int, default=max(1, cores - target_threads), help="while exporting"
    )
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    load_before = os.getloadavg()
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
        total_tokens = write_rows(rows, shape, args.rows)
        serve_args = ["--model", str(model_dir), "--engine", "hf", "--dtype", "bfloat16"]
        serve_args += ["--max-batch-tokens", str(BATCH_TOKENS), "--log-level", "WARNING"]
        threads = str(args.server_threads)
        server_env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        gpus = args.device == "cuda"
        server = start_server(tmp, serve_args, env=server_env, wait_ready=False, gpus=gpus)
        try:
            runner = load_runner("hf", model_dir, dtype="bfloat16", device=args.device)
            server.wait_until("/readyz", 200, timeout=600)
            results = {}
            # bf16 forwards of a full request take minutes on a loaded CPU, past the client's default timeout.
            with TargetClient(server.url, timeout_s=1800) as client:
                local_target = InProcessTarget(runner, client.info(), args.device)
                warm_ids = torch.zeros(1, 8, dtype=torch.int64)
                for layout in (SpeculatorsLayout(), SpecForgeLayout()):
                    prenorm = layout.name == "speculators"
                    layout.check(client.info())
                    layout.supervise(client, warm_ids, torch.ones_like(warm_ids))
                    rates: dict[str, list[float]] = {"inprocess": [], "export": [], "inprocess_export": []}
                    nbytes = requests = 0
                    for round_ in range(args.rounds):
                        torch.set_num_threads(args.inprocess_threads)
                        rates["inprocess"].append(inprocess_rate(runner, rows, prenorm, args.device))
                        out = tmp / f"{layout.name}-local-{round_}"
                        rates["inprocess_export"].append(exported_rate(local_target, rows, layout, out)[0])
                        torch.set_num_threads(args.exporter_threads)
                        out = tmp / f"{layout.name}-{round_}"
                        rate, nbytes, requests = exported_rate(client, rows, layout, out)
                        rates["export"].append(rate)
                    local, exported, local_export = (
                        max(rates[k]) for k in ("inprocess", "export", "inprocess_export")
                    )
                    results[layout.name] = {
                        "inprocess_tokens_per_s": round(local, 1),
                        "export_tokens_per_s": round(exported, 1),
                        "ratio": round(exported / local, 3),
                        "inprocess_export_tokens_per_s": round(local_export, 1),
                        "ratio_vs_inprocess_export": round(exported / local_export, 3),
                        "bytes_per_token": round(nbytes / total_tokens, 1),
                        "requests": requests,
                        **{f"{k}_rounds": [round(r) for r in v] for k, v in rates.items()},
                    }
        finally:
            server.stop()
    print(
        json.dumps(
            {
                "bench": "export",
                "device": args.device,
                "model": {k: shape[k] for k in ("hidden_size", "num_layers", "vocab_size")},
                "rows": args.rows,
                "tokens": total_tokens,
                "batch_tokens": BATCH_TOKENS,
                "rounds": args.rounds,
                "cpu_cores": cores,
                "torch_threads": {
                    "server": args.server_threads,
                    "exporter": args.exporter_threads,
                    "inprocess": args.inprocess_threads,
                },
                "server_env": server_env,
                "load_average": {
                    "before": [round(x, 2) for x in load_before],
                    "after": [round(x, 2) for x in os.getloadavg()],
                },
                "layouts": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
