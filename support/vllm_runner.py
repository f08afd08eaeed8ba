"""The vLLM runner as the CPU tests open it, on the vLLM stand-in (`support.fake_vllm`) or on real vLLM's
CPU build: fp32 on the CPU with captures under a test directory, a ragged batch to run, and tiny
checkpoints copied with a changed config to reach the runner's refusals. Shared by the test modules of the
runner's parts, the server's and the operator's real-vLLM tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from eagle3_target.runners.vllm import VLLMRunner

# Engine arguments of the tests on real vLLM: eager, because compiling a tiny model doubles an engine's start
# (about 40 s eager on two cores) and tests nothing the runner does.
CPU_ENGINE_ARGS = {"enforce_eager": "true"}


def ragged_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded rows of lengths 11, 7 and 3 (padding ids are arbitrary, masked out)."""
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, vocab_size, (3, 11), generator=gen)
    lengths = torch.tensor([11, 7, 3])
    mask = (torch.arange(11)[None, :] < lengths[:, None]).long()
    return input_ids, mask


def open_runner(model_dir: Path, shm: Path, **kwargs: Any) -> VLLMRunner:
    return VLLMRunner.from_pretrained(
        model_dir, dtype="float32", device="cpu", hidden_states_dir=shm, **kwargs
    )


def copy_model(source: Path, target: Path, **config_changes: Any) -> Path:
    """A copy of a tiny checkpoint with config.json changed (weights shared as they are)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target
