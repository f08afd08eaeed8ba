"""The HF engine on an accelerator gives the supervision it gives on CPU: one JSON line per dtype, exit 0 only
when every comparison holds.

    python scripts/hf_device_check.py --device cuda            # scripts/gpu_check.sh runs this

A seeded random Llama-style model (random norm weights, so a pre/post-norm mix-up shows) runs the same
ragged batch through `HFRunner` on --device and on --reference-device. fp32 must agree to float rounding
(TF32 matmuls are off by default in torch); bf16 kernels differ between devices, so bf16 is held to
agreement measures: the argmax of the logits, and the cosine similarity of the aux layers, the final
normed state and the logits, per position. A wrong layer, order or norm scores far below any threshold.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from eagle3_target.runners.hf import HFRunner
from eagle3_target.tiny import write_tiny_model
from torch import Tensor

app = typer.Typer(add_completion=False)

# dtype -> (largest |difference| relative to the reference's largest magnitude, for fp32; smallest
# per-position cosine and argmax agreement, for bf16).
FP32_MAX_RELATIVE_DIFF = 1e-4
BF16_MIN_COSINE = 0.99
BF16_MIN_ARGMAX = 0.95


def ragged_batch(vocab_size: int, batch: int, seq: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    lengths = torch.linspace(seq, max(1, seq // 4), batch).round().long()
    return input_ids, (torch.arange(seq)[None, :] < lengths[:, None]).long()


def supervision(runner: HFRunner, input_ids: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The runner's logits, aux and final normed state at the real positions, as fp32 on CPU; the runner
    is closed afterwards, so only one model holds device memory at a time."""
    device = runner.input_embedding_weight().device
    try:
        logits, aux = runner.forward_eagle3(input_ids.to(device), mask.to(device))
        final, _ = runner.forward_hidden(input_ids.to(device), mask.to(device))
    finally:
        runner.close()
    valid = mask.bool().to(device)
    return {name: t[valid].float().cpu() for name, t in (("logits", logits), ("aux", aux), ("final", final))}


def compare(dtype: str, tested: dict[str, Tensor], reference: dict[str, Tensor]) -> dict[str, Any]:
    """Per tensor: the largest difference relative to the reference's scale and the smallest per-position
    cosine; plus argmax agreement. Pass by the dtype's rule (see the module docstring)."""
    figures: dict[str, Any] = {}
    for name, ref in reference.items():
        got = tested[name]
        figures[f"{name}_max_relative_diff"] = float(
            (got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        )
        figures[f"{name}_min_cosine"] = float(torch.nn.functional.cosine_similarity(got, ref, dim=-1).min())
    argmax = float((tested["logits"].argmax(-1) == reference["logits"].argmax(-1)).float().mean())
    figures["argmax_agreement"] = argmax
    if dtype == "float32":
        passed = all(figures[f"{n}_max_relative_diff"] <= FP32_MAX_RELATIVE_DIFF for n in reference)
    else:
        passed = argmax >= BF16_MIN_ARGMAX and all(
            figures[f"{n}_min_cosine"] >= BF16_MIN_COSINE for n in reference
        )
    return {"pass": passed} | {k: round(v, 6) for k, v in figures.items()}


@app.command()
def main(
    device: Annotated[str, typer.Option(help="the device under test")] = "cuda",
    reference_device: Annotated[str, typer.Option()] = "cpu",
    hidden_size: Annotated[int, typer.Option()] = 512,
    num_layers: Annotated[int, typer.Option()] = 8,
    vocab_size: Annotated[int, typer.Option()] = 32000,
    batch: Annotated[int, typer.Option()] = 4,
    seq: Annotated[int, typer.Option()] = 256,
    dtypes: Annotated[str, typer.Option(help="comma-separated")] = "float32,bfloat16",
) -> None:
    passed = True
    with tempfile.TemporaryDirectory(prefix="hf-device-check-") as tmp:
        model_dir = write_tiny_model(
            Path(tmp) / "model", hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size
        )
        input_ids, mask = ragged_batch(vocab_size, batch, seq)
        for dtype in [d.strip() for d in dtypes.split(",") if d.strip()]:
            reference, tested = (
                supervision(
                    HFRunner.from_pretrained(
                        model_dir, dtype=dtype, device=where, capture_layer_ids=[5, 0, 3]
                    ),
                    input_ids,
                    mask,
                )
                for where in (reference_device, device)
            )
            line = {
                "check": "hf-engine-device",
                "device": device,
                "reference": reference_device,
                "dtype": dtype,
            }
            line |= compare(dtype, tested, reference)
            print(json.dumps(line), flush=True)
            passed = passed and bool(line["pass"])
    raise typer.Exit(0 if passed else 1)


if __name__ == "__main__":
    app()
