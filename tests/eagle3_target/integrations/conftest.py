"""A bf16 tiny Llama (random norm weights, sharded like a real checkpoint) served over loopback, capturing
the layers of every draft method's default (methods.py) besides its aux layers, and the pre-tokenised rows
every exporter and trainer test uses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from eagle3_target.tiny import write_tiny_model
from transformers import AutoModelForCausalLM

from support.server_process import ServerProcess, start_server
from support.trainer_rows import CAPTURE_LAYER_IDS, MAX_BATCH_TOKENS, MAX_MODEL_LEN, make_rows


@pytest.fixture(scope="session")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama (untied lm_head, which SpecForge's TargetHead reads from the shard index), bf16, 8 layers."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-bf16"), arch="llama", dtype="bfloat16", max_shard_size="50KB"
    )


@pytest.fixture(scope="session")
def plain_model(bf16_model_dir: Path) -> torch.nn.Module:
    """The same checkpoint loaded by transformers alone, for the independent references."""
    return AutoModelForCausalLM.from_pretrained(bf16_model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="session")
def bf16_server(bf16_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("bf16-server"),
        [
            "--model", str(bf16_model_dir),
            "--engine", "hf",
            "--dtype", "bfloat16",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-batch-tokens", str(MAX_BATCH_TOKENS),
            "--model-name", "tiny-llama-bf16",
            "--capture-layer-ids", ",".join(map(str, CAPTURE_LAYER_IDS)),
        ],
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rows() -> list[dict[str, list[int]]]:
    return make_rows()


@pytest.fixture(scope="session")
def rows_jsonl(rows: list[dict[str, list[int]]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
