"""Shared fixtures: tiny random-weight models written once per test session (no hub access)."""

from pathlib import Path

import pytest
from eagle3_target.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-style, untied lm_head, 8 layers, hidden 64, vocab 256, fp32, stored in several shards."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", max_shard_size="200KB")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-style, tied embeddings, 8 layers, hidden 64, vocab 256, fp32, one safetensors file."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")
