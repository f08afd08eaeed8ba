"""Server memory under clients that send a request and never read the answer (a frozen trainer, a node lost
without a reset, a hostile peer).

    .venv/bin/python -m bench.stalled_readers [--readers 12] [--tokens 256] [--send-timeout S]

A real `eagle3-target serve` (HF engine, a random Llama-style model with a 16384-token vocabulary) runs at its
default settings (--send-timeout passes --response-send-timeout instead of its 30 s default). After a
warm-up in which --readers clients pull the same answers and read them, --readers clients each send one
`logits` request for --tokens tokens (17 MB, 16.2 MiB, at 256) and never read. Prints one JSON object:
- answer_mib: one answer's size;
- rss_mib: the server's RSS before the stalled requests, its highest while they were held (sampled every
  0.25 s once every answer was computed), and once the server had let go of them;
- released_after_s: seconds from the requests to the server counting none of them in flight (their compute,
  the send timeout, and a quarter of a second at most for the check that sees it);
- send_timeouts: connections the server aborted (`eagle3_send_timeouts_total`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from eagle3_target.tiny import write_tiny_model
from eagle3_target.wire import tensors as tensor_wire

from support.cluster.waiting import eventually
from support.server_process import start_server
from support.supervision import bytes_per_token, in_flight, metric_samples, stalled_reader

VOCAB = 16384
HIDDEN = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--send-timeout", type=float, default=None)
    args = parser.parse_args()
    input_ids = torch.randint(0, VOCAB, (1, args.tokens))
    body = tensor_wire.encode({"input_ids": input_ids})
    with tempfile.TemporaryDirectory(prefix="bench-stalled-readers-") as tmp:
        model = write_tiny_model(Path(tmp) / "model", hidden_size=HIDDEN, vocab_size=VOCAB)
        timeout = [] if args.send_timeout is None else ["--response-send-timeout", str(args.send_timeout)]
        flags = ["--model", str(model), "--engine", "hf", "--dtype", "float32", "--max-model-len", "4096"]
        server = start_server(Path(tmp), [*flags, *timeout])
        url = server.url
        try:

            def pull(_: int) -> int:
                response = httpx.post(url + "/v1/supervision", params={"format": "logits"}, content=body)
                return response.status_code

            def computed_tokens() -> float:
                return metric_samples(url)[("eagle3_batch_tokens_sum", ())]

            with ThreadPoolExecutor(args.readers) as clients:  # the same batches, read: a warm allocator
                for _ in range(2):
                    assert set(clients.map(pull, range(args.readers))) == {200}
            computed = computed_tokens()
            before = server.memory_mib()["VmRSS"]
            started = time.monotonic()
            stalled = [stalled_reader(url, input_ids) for _ in range(args.readers)]
            # Every answer computed (a count that only grows, so no poll can miss it), then held until let go.
            expected = computed + args.readers * args.tokens
            eventually(lambda: computed_tokens() == expected, "every stalled answer to be computed")
            peak = server.memory_mib()["VmRSS"]
            while in_flight(url):
                time.sleep(0.25)
                peak = max(peak, server.memory_mib()["VmRSS"])
            released = time.monotonic() - started
            after = server.memory_mib()["VmRSS"]
            aborted = metric_samples(url)[("eagle3_send_timeouts_total", ())]
            for sock in stalled:
                sock.close()
        finally:
            server.stop()
    report = {
        "readers": args.readers,
        "answer_mib": round(args.tokens * bytes_per_token("logits", hidden=HIDDEN, vocab=VOCAB) / 2**20, 1),
        "send_timeout_s": args.send_timeout or "default",
        "rss_mib": {"before": round(before), "held_peak": round(peak), "after_release": round(after)},
        "released_after_s": round(released, 1),
        "send_timeouts": int(aborted),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
