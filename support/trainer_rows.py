"""The rows every exporter and trainer test uses, the limits of the bf16 server they are served by, and
independent references for the trainers' feature files, from a plain transformers forward of each row
alone, the way the engines the trainers were written against capture them:

- vLLM (speculators): capture id k is the residual stream entering decoder layer k, which is transformers'
  `hidden_states[k]`; id L is the input of the final norm (read with a pre-hook on `model.norm`);
- SGLang (SpecForge): aux layer i is the output of decoder layer i, `hidden_states[i + 1]`; the last hidden
  state is the final norm's output, `hidden_states[-1]`.

Nothing here uses eagle3_target's runners or formats.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

NUM_ROWS = 12
VOCAB = 256
# The bf16 server of the trainer tests: rows (20..48 tokens) fit its context; batches split at its budget.
MAX_MODEL_LEN = 64
MAX_BATCH_TOKENS = 256
# What the bf16 server (8 layers) captures: every method's default layers (eagle3 [1, 3, 4], dflash
# [1, 2, 3, 4, 5], dspark [1, 2, 4, 6]); layer 0 is left out, for the tests of layers a target lacks.
CAPTURE_LAYER_IDS = [1, 2, 3, 4, 5, 6]


def make_rows(num_rows: int = NUM_ROWS, seed: int = 3) -> list[dict[str, list[int]]]:
    """Rows of distinct lengths 20..48 with a prompt part (loss 0) and a response part (loss 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randperm(29, generator=g)[:num_rows] + 20
    rows = []
    for n in lengths.tolist():
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        prompt = int(torch.randint(3, n // 2, (1,), generator=g))
        mask = [0] * prompt + [1] * (n - prompt)
        rows.append({"input_ids": ids.tolist(), "loss_mask": mask})
    return rows


def capture(model: nn.Module, input_ids: list[int]) -> tuple[tuple[Tensor, ...], Tensor]:
    """(transformers' hidden_states, the final norm's input), for one row run alone."""
    seen: list[Tensor] = []
    norm: nn.Module = model.model.norm  # type: ignore[assignment]  # transformers declares it Tensor | Module
    hook = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return out.hidden_states, seen[0]


def vllm_file(model: nn.Module, input_ids: list[int], capture_ids: list[int]) -> dict[str, Tensor]:
    """What vLLM's hidden-states connector writes for `capture_ids` (ascending, plus L for the last)."""
    hidden_states, prenorm = capture(model, input_ids)
    num_layers = len(hidden_states) - 1
    layers = [prenorm[0] if k == num_layers else hidden_states[k][0] for k in capture_ids]
    return {"hidden_states": torch.stack(layers, dim=1), "token_ids": torch.tensor(input_ids)}


def sglang_record(model: nn.Module, row: dict[str, list[int]], aux_layer_ids: list[int]) -> dict[str, Tensor]:
    """What SpecForge's prepare_hidden_states.py saves for one row (bf16 model)."""
    hidden_states, _ = capture(model, row["input_ids"])
    return {
        "input_ids": torch.tensor(row["input_ids"]),
        "loss_mask": torch.tensor(row["loss_mask"]),
        "hidden_state": hidden_states[-1].to(torch.bfloat16),
        "aux_hidden_state": torch.cat([hidden_states[i + 1] for i in aux_layer_ids], dim=-1).to(
            torch.bfloat16
        ),
    }


def add_mtp_head(model_dir: Path, out: Path, seed: int = 5) -> Path:
    """A copy of a tiny Qwen3 checkpoint (one safetensors file) with a native MTP head, as Qwen3-Next and
    Qwen3.5 ship it (`mtp.fc`, `mtp.norm`, `mtp.pre_fc_norm_hidden|embedding`, `mtp.layers.0.*`): what
    speculators' MTP draft is extracted from. Random like the rest; its decoder layer starts near layer 0's.
    vLLM refuses `mtp.*` tensors for a plain Qwen3, so it serves the original (the same decoder stack)."""
    shutil.copytree(model_dir, out)
    model_dir = out
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    g = torch.Generator().manual_seed(seed)
    hidden = weights["model.norm.weight"].shape[0]
    head = {
        f"mtp.layers.0.{name.removeprefix('model.layers.0.')}": w + 0.01 * torch.randn(w.shape, generator=g)
        for name, w in weights.items()
        if name.startswith("model.layers.0.")
    }
    head["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=g)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        head[f"mtp.{norm}.weight"] = 1 + 0.2 * torch.randn(hidden, generator=g)
    save_file(weights | head, path, metadata={"format": "pt"})
    return model_dir


def write_vllm_files(
    model: nn.Module, rows: list[dict[str, list[int]]], capture_ids: list[int], out: Path
) -> Path:
    """`out/hidden_states/hs_{i}.safetensors` per row, as `speculators generate-offline-data` leaves them."""
    directory = out / "hidden_states"
    directory.mkdir(parents=True)
    for i, row in enumerate(rows):
        save_file(vllm_file(model, row["input_ids"], capture_ids), directory / f"hs_{i}.safetensors")
    return directory


def write_sglang_files(
    model: nn.Module, rows: list[dict[str, list[int]]], aux_layer_ids: list[int], out: Path
) -> Path:
    """`out/rows_0-2000/data_{i}.ckpt` for every row, as SpecForge's prepare_hidden_states.py leaves them."""
    directory = out / "rows_0-2000"
    directory.mkdir(parents=True)
    for i, row in enumerate(rows):
        torch.save(sglang_record(model, row, aux_layer_ids), directory / f"data_{i}.ckpt")
    return out
