"""GPU smoke test: the vLLM engine's EAGLE-3 supervision against the HF engine's on a real model.

Needs a CUDA GPU and `vllm==0.33.0` (the target image has both). Runs the same seeded random batch through
both engines and prints one JSON object: top-1 (argmax) agreement of the logits, per-aux-layer cosine
similarity of the captured hidden states, and tokens/s of each engine. Exit code 0 only when
argmax agreement >= --min-argmax and every layer's cosine >= --min-cosine.

    python scripts/smoke_vllm.py --model /models/Llama-3.1-8B-Instruct --engine-arg max_model_len=4096

The two engines use different kernels (and vLLM fuses the residual add), so bf16 results are close but not
identical; the thresholds catch wrong layers, wrong order or a wrong logits rebuild, which score far lower.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
import typer
from eagle3_target.runners.hf import HFRunner
from eagle3_target.runners.vllm import DEFAULT_HIDDEN_STATES_DIR, VLLMRunner
from torch import Tensor

app = typer.Typer(add_completion=False)


def ragged_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
    """Random token ids, right-padded rows from full length down to a quarter of it."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    lengths = torch.linspace(seq_len, max(1, seq_len // 4), batch_size).round().long()
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return input_ids, mask


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(forward: Callable[[], tuple[Tensor, Tensor]], repeats: int) -> tuple[tuple[Tensor, Tensor], float]:
    """Result of one warm-up call and the mean wall time of `repeats` further calls."""
    result = forward()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        forward()
    synchronize()
    return result, (time.perf_counter() - start) / repeats


def aux_cosines(aux: Tensor, reference: Tensor, valid: Tensor, hidden_size: int) -> list[float]:
    """Mean cosine similarity per aux layer over the real (unpadded) positions."""
    return [
        torch.nn.functional.cosine_similarity(
            aux[..., i * hidden_size : (i + 1) * hidden_size][valid].float(),
            reference[..., i * hidden_size : (i + 1) * hidden_size][valid].float(),
            dim=-1,
        )
        .mean()
        .item()
        for i in range(aux.shape[-1] // hidden_size)
    ]


def parse_engine_args(pairs: list[str]) -> dict[str, str]:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--engine-arg expects KEY=VALUE, got {pair!r}")
        parsed[key] = value
    return parsed


@app.command()
def main(
    model: Annotated[Path, typer.Option(help="local model directory")],
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    device: Annotated[str, typer.Option()] = "cuda",
    aux_layer_ids: Annotated[list[int] | None, typer.Option(help="3 ids, repeat the flag")] = None,
    batch_size: Annotated[int, typer.Option()] = 8,
    seq_len: Annotated[int, typer.Option()] = 512,
    repeats: Annotated[int, typer.Option(help="timed calls per engine")] = 3,
    seed: Annotated[int, typer.Option()] = 0,
    engine_arg: Annotated[list[str] | None, typer.Option(help="vLLM KEY=VALUE, repeatable")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's share; HF needs the rest")] = 0.45,
    hidden_states_dir: Annotated[Path, typer.Option()] = Path(DEFAULT_HIDDEN_STATES_DIR),
    min_argmax: Annotated[float, typer.Option()] = 0.95,
    min_cosine: Annotated[float, typer.Option()] = 0.99,
) -> None:
    engine_kwargs = {"gpu_memory_utilization": str(gpu_memory_utilization)} | parse_engine_args(
        engine_arg or []
    )
    # vLLM first: it sizes its KV cache from free memory and prefers to start before CUDA is in use here.
    vllm_runner = VLLMRunner.from_pretrained(
        model,
        dtype=dtype,
        device=device,
        aux_layer_ids=aux_layer_ids,
        hidden_states_dir=hidden_states_dir,
        **engine_kwargs,
    )
    hf_runner = HFRunner.from_pretrained(
        model, dtype=dtype, device=device, aux_layer_ids=vllm_runner.aux_layer_ids
    )
    config = vllm_runner.model.config
    input_ids, mask = ragged_batch(config.vocab_size, batch_size, seq_len, seed)
    tokens = int(mask.sum())
    try:
        (v_logits, v_aux), v_seconds = timed(lambda: vllm_runner.forward_eagle3(input_ids, mask), repeats)
        (h_logits, h_aux), h_seconds = timed(
            lambda: hf_runner.forward_eagle3(input_ids.to(device), mask.to(device)), repeats
        )
    finally:
        vllm_runner.close()
    valid = mask.bool().to(device)
    argmax_agreement = (v_logits.argmax(-1) == h_logits.argmax(-1))[valid].float().mean().item()
    cosines = aux_cosines(v_aux, h_aux, valid, config.hidden_size)
    passed = argmax_agreement >= min_argmax and min(cosines) >= min_cosine
    report = {
        "model": str(model),
        "dtype": dtype,
        "aux_layer_ids": vllm_runner.aux_layer_ids,
        "tokens_per_batch": tokens,
        "argmax_agreement": round(argmax_agreement, 4),
        "aux_cosine_per_layer": [round(c, 5) for c in cosines],
        "vllm_tokens_per_s": round(tokens / v_seconds, 1),
        "hf_tokens_per_s": round(tokens / h_seconds, 1),
        "thresholds": {"argmax": min_argmax, "cosine": min_cosine},
        "pass": passed,
    }
    print(json.dumps(report, indent=2))
    raise typer.Exit(0 if passed else 1)


if __name__ == "__main__":
    app()
