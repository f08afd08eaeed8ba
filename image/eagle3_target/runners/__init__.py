"""Target runners. Engines import lazily so the package works where vLLM (or CUDA) is absent."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from eagle3_target.runners.base import (
    InvalidInput,
    ModelInfo,
    ModelRefused,
    TargetRunner,
    check_inputs,
    model_info,
)

ENGINES = ("hf", "vllm")

__all__ = [
    "ENGINES",
    "InvalidInput",
    "ModelInfo",
    "ModelRefused",
    "TargetRunner",
    "check_engine_args",
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
    check_engine_args(engine, engine_kwargs)
    if engine == "hf":
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
    raise AssertionError(f"check_engine_args let engine {engine!r} through")


def check_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    """Refuse, before anything loads, an engine or engine arguments that loading would refuse."""
    if engine == "hf":
        if engine_kwargs:
            raise ModelRefused(
                f"the hf engine takes no engine arguments, got {sorted(engine_kwargs)}: drop the "
                "--engine-arg flags (they are vLLM's) or use --engine vllm"
            )
    elif engine == "vllm":
        from eagle3_target.runners.vllm_args import RUNNER_OPTIONS, vllm_engine_kwargs

        vllm_engine_kwargs({key: value for key, value in engine_kwargs.items() if key not in RUNNER_OPTIONS})
    else:
        raise ModelRefused(f"unknown engine {engine!r}; expected one of {ENGINES}")
