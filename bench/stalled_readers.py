"""Server memory under clients that send a request and never read the answer (a frozen trainer, a node lost
without a reset, a hostile peer).

    .venv/bin/python -m bench.stalled_readers [--readers 12] [--tokens 256] [--send-timeout S]

A real `eagle3-target serve` (HF engine, a random Llama-style model with a 16384-token vocabulary) runs at its
default settings (--send-timeout passes --response-send-timeout instead of its 30 s default). After a
warm-up in which --readers clients pull the same answers and read them, --readers clients each send one
`logits` request for --tokens tokens (17 MB, 16.2 MiB, at 256) and never read. Prints one JSON object:
- answer_mib: one answer's size;
- rss_mib: the server's RSS before the stalled requests, its highest while they were held (sampled every
  0.25 s), and once the server had let go of them;
- released_after_s: seconds from the requests to the server counting none of them in flight (the send
  timeout, and a quarter of it at most for the check that sees it);
- send_timeouts: connections the server aborted (`eagle3_send_timeouts_total`).
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from eagle3_target.tiny import write_tiny_model
from eagle3_target.wire import tensors as tensor_wire

from support.cluster.waiting import LOOPBACK
from support.server_process import start_server
from support.supervision import metric_samples

VOCAB = 16384
# fp32 logits and three fp32 aux hidden states of width 64, per token.
BYTES_PER_TOKEN = VOCAB * 4 + 3 * 64 * 4


def in_flight(url: str) -> int:
    return int(httpx.get(url + "/readyz").json()["activity"]["inFlight"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--send-timeout", type=float, default=None)
    args = parser.parse_args()
    body = tensor_wire.encode({"input_ids": torch.randint(0, VOCAB, (1, args.tokens))})
    head = (
        f"POST /v1/supervision?format=logits HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with tempfile.TemporaryDirectory(prefix="bench-stalled-readers-") as tmp:
        model = write_tiny_model(Path(tmp) / "model", vocab_size=VOCAB)
        timeout = [] if args.send_timeout is None else ["--response-send-timeout", str(args.send_timeout)]
        flags = ["--model", str(model), "--engine", "hf", "--dtype", "float32", "--max-model-len", "4096"]
        server = start_server(Path(tmp), [*flags, *timeout])
        url = server.url
        try:

            def pull(_: int) -> int:
                response = httpx.post(url + "/v1/supervision", params={"format": "logits"}, content=body)
                return response.status_code

            with ThreadPoolExecutor(args.readers) as clients:  # the same batches, read: a warm allocator
                for _ in range(2):
                    assert set(clients.map(pull, range(args.readers))) == {200}
            before = server.memory_mib()["VmRSS"]
            started = time.monotonic()
            stalled = []
            for _ in range(args.readers):
                sock = socket.create_connection((LOOPBACK, int(url.rsplit(":", 1)[1])))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(head + body)
                stalled.append(sock)
            peak = before
            while in_flight(url) or time.monotonic() - started < 1:
                peak = max(peak, server.memory_mib()["VmRSS"])
                time.sleep(0.25)
            released = time.monotonic() - started
            after = server.memory_mib()["VmRSS"]
            aborted = metric_samples(url)[("eagle3_send_timeouts_total", ())]
            for sock in stalled:
                sock.close()
        finally:
            server.stop()
    report = {
        "readers": args.readers,
        "answer_mib": round(args.tokens * BYTES_PER_TOKEN / 2**20, 1),
        "send_timeout_s": args.send_timeout or "default",
        "rss_mib": {"before": round(before), "held_peak": round(peak), "after_release": round(after)},
        "released_after_s": round(released, 1),
        "send_timeouts": int(aborted),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
