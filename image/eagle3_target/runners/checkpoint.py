"""Read a target's output-side weights (input embeddings, final norm, LM head) straight from its checkpoint.

Engines such as vLLM keep the model's weights in another process, so the few tensors needed to rebuild
logits from the captured pre-norm hidden state (and to serve `/v1/weights/*`) are read from the
safetensors files on disk instead: one file (`model.safetensors`) or shards listed in
`model.safetensors.index.json`. Only the named tensors are read, never the whole checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

# Tensor names in the order they are tried: causal-LM layout first, then the multimodal wrappers' layouts.
EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
FINAL_NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


@dataclass(frozen=True)
class HeadWeights:
    """The output-side weights of a causal LM, already in the model dtype and on the serving device."""

    input_embeddings: Tensor  # [V, H]
    final_norm: Tensor  # [H]
    lm_head: Tensor  # [V, H]; the input embeddings themselves for tied models


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"{model_dir} holds neither {SINGLE_FILE} nor {SHARD_INDEX}")


def read_first(files: dict[str, Path], names: tuple[str, ...]) -> Tensor | None:
    """The first of `names` present in the checkpoint, or None when none is."""
    for name in names:
        if name in files:
            with safe_open(files[name], framework="pt") as f:
                return f.get_tensor(name)
    return None


def check_shape(name: str, tensor: Tensor, rows: int | None, hidden_size: int) -> Tensor:
    """Check a [rows, H] (or [H] when rows is None) weight; trim rows past `rows` (vocab padding)."""
    if rows is None:
        if tuple(tensor.shape) != (hidden_size,):
            raise ValueError(f"checkpoint {name} has shape {tuple(tensor.shape)}, expected ({hidden_size},)")
        return tensor
    if tensor.dim() != 2 or tensor.shape[1] != hidden_size or tensor.shape[0] < rows:
        raise ValueError(
            f"checkpoint {name} has shape {tuple(tensor.shape)}, expected ({rows}, {hidden_size}) "
            "(rows past vocab_size are allowed as padding)"
        )
    return tensor[:rows]


def load_head_weights(
    model_dir: str | Path,
    *,
    vocab_size: int,
    hidden_size: int,
    tie_word_embeddings: bool,
    dtype: torch.dtype,
    device: torch.device | str,
) -> HeadWeights:
    """Load the input embeddings, final norm and LM head; a tied model's LM head is its input embeddings."""
    files = tensor_files(Path(model_dir))
    embeddings = read_first(files, EMBEDDING_NAMES)
    norm = read_first(files, FINAL_NORM_NAMES)
    if embeddings is None or norm is None:
        raise ValueError(
            f"checkpoint {model_dir} lacks the input embeddings ({' or '.join(EMBEDDING_NAMES)}) "
            f"or the final norm ({' or '.join(FINAL_NORM_NAMES)})"
        )
    embeddings = check_shape("input embeddings", embeddings, vocab_size, hidden_size)
    norm = check_shape("final norm", norm, None, hidden_size)
    if tie_word_embeddings:
        lm_head = embeddings
    else:
        untied = read_first(files, LM_HEAD_NAMES)
        if untied is None:
            raise ValueError(
                f"checkpoint {model_dir} has untied embeddings but no LM head ({' or '.join(LM_HEAD_NAMES)})"
            )
        lm_head = check_shape("LM head", untied, vocab_size, hidden_size)

    def place(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    embeddings = place(embeddings)
    return HeadWeights(
        input_embeddings=embeddings,
        final_norm=place(norm),
        lm_head=embeddings if tie_word_embeddings else place(lm_head),
    )
