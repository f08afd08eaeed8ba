"""Data-plane throughput: how fast the server ships supervision when the engine costs nothing.

    .venv/bin/python -m bench.data_plane [--shape 8b|70b] [--batch 4] [--seq 2048] [--reps 4] [--rounds 2]

A real `eagle3-target serve` (HF engine) runs a model with a real model's widths (Llama-3.1-8B: hidden
4096; 70B: 8192; 8 layers, one attention head and a tiny MLP, so the weights stay small) whose
`forward_hidden` returns ready bf16 tensors: what is measured is the server, the wire and the client, not the
model. Two cases, each on its own server, --batch x --seq tokens a request:
- `hidden`: `format=hidden`, the EAGLE-3 answer (the final state and 3 aux layers: 268 MB at 8B sizes);
- `layers_dflash`: `format=layers`, DFlash's shape: 5 layers (NeMo's DFlash default ids for this depth,
  [1, 2, 3, 4, 5], the server's whole capture set) and `final=prenorm` (403 MB at 8B sizes), read with
  `TargetClient.hidden_states`.
Prints one JSON object: the run's settings, and per case (each figure the best of --rounds rounds):
- loopback_tcp_gbps: one TCP stream over 127.0.0.1 between two processes (sendall of the server's chunk
  size / recv_into a warm buffer), moving that case's answer size;
- raw_c1_gbps: one client reading the body with plain sockets into a preallocated buffer, no decode;
- client_c1 / client_c4: `TargetClient` in 1 and 4 client processes (read, decode): GB/s and tokens/s
  summed over the clients;
- ratios: raw and TargetClient over loopback TCP, 4 clients over 1 (goals: >= 0.5, >= 0.4, >= 0.9);
- readyz_seconds: p50 / p99 / max of `/readyz` (a fresh connection each time, as kubelet probes) while 4
  clients pull (goal <= 0.25 s);
- server_rss_mib: the server's RSS once ready and its peak (VmHWM) over the run, and the difference over
  one answer (the runner keeps one answer's ready tensors, made on the first request: 1.0 means the server
  copied nothing while it streamed answers to 4 clients).
`layers_over_hidden` compares the two cases' TargetClient rates (goal: the layers format stays at the
wire's speed, as `hidden` does).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import numpy as np
import torch
from eagle3_target.client import TargetClient
from eagle3_target.protocol import LAYERS_FORMAT, LayerSelection
from eagle3_target.server.streaming import CHUNK_BYTES

from support.cluster.waiting import LOOPBACK, free_port
from support.server_process import ServerProcess, connect, launch

SHAPES = {"8b": 4096, "70b": 8192}


def cpu_split() -> tuple[set[int], set[int]]:
    """(server's CPUs, clients' CPUs). With two or more CPUs the server runs on the first and every client
    on the others, as trainers on other nodes would: clients then share their CPUs, not the server's, and
    4 clients measure what the server does for them."""
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[:1]), set(cpus[1:]) or set(cpus)


VOCAB = 1024
LAYERS = 8


@dataclass(frozen=True)
class Case:
    """One answer shape: the server's capture set, the request and how many [B,S,H] states it ships."""

    name: str
    capture_layer_ids: tuple[int, ...]
    params: dict[str, str]
    states: int

    def pull(self, client: TargetClient, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The answer as a trainer reads it: `supervise` for an EAGLE-3 format, `hidden_states` for layers."""
        if self.params["format"] != LAYERS_FORMAT:
            return client.supervise(ids, format=self.params["format"])
        wanted = LayerSelection.parse(self.params["layers"], self.params["final"], self.capture_layer_ids)
        return client.hidden_states(ids, layers=wanted.layers, final=wanted.final)


# The default aux layers of an 8-layer model, [1, 3, 4], are what `hidden` ships beside the final state.
HIDDEN = Case("hidden", (1, 3, 4), {"format": "hidden"}, 4)
# NeMo's DFlash default for 5 draft layers over 8 target layers is [1, 2, 3, 4, 5]; captured exactly, in that
# order, the answer is the runner's captured tensor itself, as `hidden`'s aux layers are.
DFLASH = Case(
    "layers_dflash",
    (1, 2, 3, 4, 5),
    {"format": LAYERS_FORMAT, "layers": "1,2,3,4,5", "final": "prenorm"},
    6,
)
CASES = (HIDDEN, DFLASH)


def write_wide_model(out: Path, hidden: int) -> Path:
    """A random Llama of the given width whose weights are small: one 32-wide head, a 32-wide MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def serve_ready_tensors(argv: list[str]) -> None:
    """`eagle3-target serve` with an HF runner whose forward returns ready tensors (run in the child)."""
    from eagle3_target.cli import main
    from eagle3_target.runners.hf import HFRunner

    ready: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward_hidden(self: HFRunner, input_ids: torch.Tensor, *_args: object, **_kwargs: object):
        batch, seq = input_ids.shape
        hidden = self.model.config.hidden_size
        key = (batch, seq, hidden)
        if key not in ready:
            # Made in bf16 directly, so the server's peak memory holds no fp32 draft of them.
            ready[key] = (
                torch.randn(batch, seq, hidden, dtype=torch.bfloat16),
                torch.randn(batch, seq, len(self.capture_layer_ids) * hidden, dtype=torch.bfloat16),
            )
        return ready[key]

    HFRunner.forward_hidden = forward_hidden  # type: ignore[method-assign]
    sys.argv = ["eagle3-target", *argv]
    main()


def start_ready_server(log_dir: Path, args: list[str], cpus: set[int]) -> ServerProcess:
    port = free_port()
    program = [sys.executable, "-m", "bench.data_plane", "--serve"]
    server = launch(log_dir / "server.log", port, args, program=program)
    os.sched_setaffinity(server.process.pid, cpus)
    server.wait_until("/readyz", 200, timeout=600)
    return server


# --- loopback TCP baseline -----------------------------------------------------------------------------


def _tcp_sender(port: int, nbytes: int, repeats: int, cpus: set[int]) -> None:
    """Sends in the server's chunk size: one huge send holds the socket's lock while ACKs wait, and is slower
    than the server's own writes."""
    os.sched_setaffinity(0, cpus)
    payload = np.ones(nbytes, dtype=np.uint8).data
    with socket.create_connection((LOOPBACK, port)) as sock:
        for _ in range(repeats):
            for start in range(0, nbytes, CHUNK_BYTES):
                sock.sendall(payload[start : start + CHUNK_BYTES])


def loopback_tcp_gbps(nbytes: int, repeats: int, sender_cpus: set[int]) -> float:
    buffer = np.ones(nbytes, dtype=np.uint8).data  # warm, like the client's reused buffers
    with socket.create_server((LOOPBACK, 0)) as listener:
        port = listener.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        sender = ctx.Process(target=_tcp_sender, args=(port, nbytes, repeats, sender_cpus))
        sender.start()
        conn, _ = listener.accept()
        with conn:
            best = 0.0
            for _ in range(repeats):
                started = time.perf_counter()
                filled = 0
                while filled < nbytes:
                    filled += conn.recv_into(buffer[filled:])
                best = max(best, nbytes / (time.perf_counter() - started) / 1e9)
        sender.join()
    return best


# --- clients -------------------------------------------------------------------------------------------


def _request_body(batch: int, seq: int) -> bytes:
    from eagle3_target.wire.tensors import encode

    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    return encode({"input_ids": ids})


def raw_client_gbps(url: str, case: Case, body: bytes, reps: int) -> float:
    """One keep-alive connection, plain sockets: the request out, the body into one reused buffer."""
    head = (
        f"POST /v1/supervision?{urlencode(case.params)} HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    buffer = bytearray()
    best = 0.0
    with connect(url, timeout=None) as sock:
        stream = sock.makefile("rb")
        for _ in range(reps + 1):  # the first one warms up
            started = time.perf_counter()
            sock.sendall(head + body)
            status = stream.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"server answered {status!r}")
            length = 0
            while (line := stream.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            if len(buffer) < length:
                buffer = bytearray(length)
            view = memoryview(buffer)[:length]
            filled = 0
            while filled < length:
                got = stream.readinto(view[filled:])
                if not got:
                    raise RuntimeError("connection closed mid-body")
                filled += got
            best = max(best, length / (time.perf_counter() - started) / 1e9)
    return best


def _target_client_worker(
    url: str, case: Case, batch: int, seq: int, reps: int, cpus, start, results
) -> None:
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    with TargetClient(url, timeout_s=600) as client:
        # Warm-up: the connection, and the two body buffers a caller holding one answer while it fetches the
        # next keeps reusing (a trainer with prefetch holds a few the same way).
        warm = [case.pull(client, ids) for _ in range(2)]
        del warm
        start.wait()
        started = time.perf_counter()
        received = 0
        for _ in range(reps):
            out = case.pull(client, ids)
            received += sum(t.numel() * t.element_size() for t in out.values())
        results.put((received, batch * seq * reps, started, time.perf_counter()))


def target_client_rate(
    url: str, case: Case, answer_bytes: int, clients: int, batch: int, seq: int, reps: int, cpus: set[int]
) -> dict[str, float]:
    """GB/s and tokens/s summed over `clients` processes, each a TargetClient pulling `reps` batches of
    `answer_bytes` tensor data (checked: a wrong answer is not a rate)."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(clients + 1), ctx.Queue()
    workers = [
        ctx.Process(target=_target_client_worker, args=(url, case, batch, seq, reps, cpus, start, results))
        for _ in range(clients)
    ]
    for worker in workers:
        worker.start()
    start.wait(timeout=600)
    done = [results.get(timeout=1200) for _ in workers]
    for worker in workers:
        worker.join()
    wrong = [nbytes for nbytes, *_ in done if nbytes != reps * answer_bytes]
    if wrong:
        raise RuntimeError(f"{case.name}: clients received {wrong} bytes, not {reps} x {answer_bytes}")
    elapsed = max(end for *_, end in done) - min(begin for _, _, begin, _ in done)
    return {
        "gbps": round(sum(nbytes for nbytes, *_ in done) / elapsed / 1e9, 3),
        "tokens_per_s": round(sum(tokens for _, tokens, *_ in done) / elapsed, 1),
    }


def probe_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        httpx.get(url + "/readyz", timeout=30).raise_for_status()
        out.append(time.perf_counter() - started)
        stop.wait(0.05)


def measure(
    case: Case, model: Path, log_dir: Path, args: argparse.Namespace, cpus: tuple[set[int], set[int]]
) -> dict[str, Any]:
    """Every figure of one case, on a server of its own (its capture set), the best of --rounds rounds."""
    server_cpus, client_cpus = cpus
    tokens = args.batch * args.seq
    hidden = SHAPES[args.shape]
    answer_bytes = tokens * case.states * hidden * 2
    capture = ",".join(map(str, case.capture_layer_ids))
    serve_args = ["--model", str(model), "--engine", "hf", "--dtype", "bfloat16", "--log-level", "WARNING"]
    serve_args += ["--max-model-len", str(args.seq), "--max-batch-tokens", str(tokens)]
    serve_args += ["--capture-layer-ids", capture]
    server = start_ready_server(log_dir, serve_args, server_cpus)
    pulls = (args.batch, args.seq, args.reps, client_cpus)
    try:
        rss_ready = server.memory_mib()["VmRSS"]
        served = httpx.get(server.url + "/v1/info", timeout=30, trust_env=False).json()["capture_layer_ids"]
        body = _request_body(args.batch, args.seq)
        tcp = raw = 0.0
        c1: dict[str, float] = {"gbps": 0.0, "tokens_per_s": 0.0}
        c4 = dict(c1)
        latencies: list[float] = []
        for _ in range(args.rounds):
            tcp = max(tcp, loopback_tcp_gbps(answer_bytes, args.reps, server_cpus))
            raw = max(raw, raw_client_gbps(server.url, case, body, args.reps))
            c1 = max(c1, target_client_rate(server.url, case, answer_bytes, 1, *pulls), key=_gbps)
            stop = threading.Event()
            prober = threading.Thread(target=probe_latencies, args=(server.url, stop, latencies))
            prober.start()
            try:
                c4 = max(c4, target_client_rate(server.url, case, answer_bytes, 4, *pulls), key=_gbps)
            finally:
                stop.set()
                prober.join()
        rss = server.memory_mib()
    finally:
        server.stop()
    latencies.sort()
    return {
        "request": f"POST /v1/supervision?{urlencode(case.params)}",
        "capture_layer_ids": served,  # as the server reports it
        "answer_mb": round(answer_bytes / 1e6, 1),
        "loopback_tcp_gbps": round(tcp, 3),
        "raw_c1_gbps": round(raw, 3),
        "client_c1": c1,
        "client_c4": c4,
        "ratios": {
            "raw_over_tcp": round(raw / tcp, 3),
            "client_c1_over_tcp": round(c1["gbps"] / tcp, 3),
            "client_c4_over_c1": round(c4["gbps"] / c1["gbps"], 3),
        },
        "readyz_seconds": {
            "samples": len(latencies),
            "p50": round(statistics.median(latencies), 4),
            "p99": round(latencies[int(0.99 * (len(latencies) - 1))], 4),
            "max": round(latencies[-1], 4),
        },
        "server_rss_mib": {
            "ready": round(rss_ready, 1),
            "peak": round(rss["VmHWM"], 1),
            "peak_over_ready_per_answer": round((rss["VmHWM"] - rss_ready) * 2**20 / answer_bytes, 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=4, help="requests per client per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    hidden = SHAPES[args.shape]
    server_cpus, client_cpus = cpu_split()
    os.sched_setaffinity(0, client_cpus)  # this process is a client too: the baselines' receiver, the probes
    report: dict[str, Any] = {
        "bench": "data_plane",
        "shape": args.shape,
        "hidden_size": hidden,
        "batch": [args.batch, args.seq],
        "reps_per_client": args.reps,
        "cpus": {"server": sorted(server_cpus), "clients": sorted(client_cpus)},
        "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory(prefix="bench-data-plane-") as tmp:
        model = write_wide_model(Path(tmp) / "model", hidden)
        for case in CASES:
            log_dir = Path(tmp) / case.name
            log_dir.mkdir()
            report[case.name] = measure(case, model, log_dir, args, (server_cpus, client_cpus))
    hidden_rate, layers_rate = report[HIDDEN.name]["client_c1"], report[DFLASH.name]["client_c1"]
    report["layers_over_hidden"] = {
        "client_c1_gbps": round(layers_rate["gbps"] / hidden_rate["gbps"], 3),
        "client_c1_tokens_per_s": round(layers_rate["tokens_per_s"] / hidden_rate["tokens_per_s"], 3),
    }
    print(json.dumps(report, indent=2))


def _gbps(rate: dict[str, float]) -> float:
    return rate["gbps"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve_ready_tensors(sys.argv[2:])
    else:
        main()
