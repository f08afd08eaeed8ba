"""Target runners. Engines import lazily so the package works where vLLM (or CUDA) is absent."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from eagle3_target.runners.base import InvalidInput, ModelInfo, TargetRunner, check_inputs, model_info

ENGINES = ("hf", "vllm")

__all__ = [
    "ENGINES",
    "InvalidInput",
    "ModelInfo",
    "TargetRunner",
    "check_inputs",
    "load_runner",
    "model_info",
]


def load_runner(
    engine: str,
    model_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype,
    aux_layer_ids: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    **engine_kwargs: Any,
) -> TargetRunner:
    """Load a local model directory with the named engine ("hf" or "vllm")."""
    if engine == "hf":
        if engine_kwargs:
            raise ValueError(f"the hf engine takes no engine arguments, got {sorted(engine_kwargs)}")
        from eagle3_target.runners.hf import HFRunner

        return HFRunner.from_pretrained(
            model_path,
            dtype=dtype,
            device=device,
            aux_layer_ids=aux_layer_ids,
            trust_remote_code=trust_remote_code,
        )
    if engine == "vllm":
        from eagle3_target.runners.vllm import VLLMRunner

        return VLLMRunner.from_pretrained(
            model_path,
            dtype=dtype,
            device=device,
            aux_layer_ids=aux_layer_ids,
            trust_remote_code=trust_remote_code,
            **engine_kwargs,
        )
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
