"""Helpers shared by the client tests: fixed-port servers and seeded token batches."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from tests.eagle3_target.server.server_process import LOOPBACK, ServerProcess, serve_command


def start_on_port(log_dir: Path, port: int, args: list[str]) -> ServerProcess:
    """A server on a fixed port (to restart "the same" endpoint); returns as soon as the process runs."""
    log_path = log_dir / f"server-{port}-{len(list(log_dir.glob('*.log')))}.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [*serve_command(), "serve", "--host", LOOPBACK, "--port", str(port), *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
    return ServerProcess(f"http://{LOOPBACK}:{port}", process, log_path)


def token_batch(seed: int, batch: int = 2, seq: int = 16, vocab: int = 256) -> tuple[torch.Tensor, ...]:
    """A seeded (input_ids, attention_mask, loss_mask) with a padded tail on the last row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, seq - 3 :] = 0
    loss_mask = torch.randint(0, 2, (batch, seq), generator=g) * attention_mask
    return input_ids, attention_mask, loss_mask
