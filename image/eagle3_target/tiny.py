"""Tiny random-weight causal LMs written to disk, so tests and demos load a real model with no hub access."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch

from eagle3_target.runners.base import parse_dtype

ARCHS = ("llama", "qwen3")
# Head dim hidden_size / NUM_HEADS: 32 at the default width, the smallest vLLM's CPU attention takes.
NUM_HEADS = 2
NUM_KV_HEADS = 1
MAX_POSITIONS = 1024
# Larger than transformers' 0.02 so random logits are peaked enough that argmax and the draft-vocab
# position mask vary across positions instead of sitting on near-uniform distributions.
INIT_STD = 0.1
# RMSNorm weights are drawn from [1 - s, 1 + s] instead of left at 1: with unit weights norm(norm(x)) equals
# norm(x), so a test could not tell a pre-norm hidden state from a post-norm one.
NORM_WEIGHT_SPREAD = 0.5


def write_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Literal["llama", "qwen3"] = "llama",
    num_layers: int = 8,
    hidden_size: int = 64,
    vocab_size: int = 256,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    num_kv_heads: int = NUM_KV_HEADS,
) -> Path:
    """Save a seeded random model: Llama-style with an untied lm_head, or Qwen3-style with tied embeddings.
    Every norm weight is random too (see `NORM_WEIGHT_SPREAD`).

    `num_kv_heads` (1 or `NUM_HEADS`): 2 lets tensor parallelism over two ranks split the KV heads too.
    `max_shard_size` (e.g. "50KB") splits the safetensors into shards with an index, like large checkpoints.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if hidden_size % (2 * NUM_HEADS):  # rotary embeddings need an even head dim
        raise ValueError(f"hidden_size must be a multiple of {2 * NUM_HEADS}, got {hidden_size}")
    common = {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=hidden_size // NUM_HEADS, tie_word_embeddings=True)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    torch_dtype = parse_dtype(dtype)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError("dtype must be concrete (e.g. float32, bfloat16), not 'auto'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(1 - NORM_WEIGHT_SPREAD, 1 + NORM_WEIGHT_SPREAD)
    model = model.to(torch_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out
