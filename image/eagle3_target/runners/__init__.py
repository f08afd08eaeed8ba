"""Target runners behind one protocol, loaded by engine name (see `eagle3_target.engines`). Engines import
lazily, so the package works where vLLM (or CUDA) is absent."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from eagle3_target.engines import ENGINES
from eagle3_target.runners.base import (
    InvalidInput,
    ModelInfo,
    ModelRefused,
    TargetRunner,
    check_inputs,
    model_info,
)

__all__ = [
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
    capture_layer_ids: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    **engine_kwargs: Any,
) -> TargetRunner:
    """Load a local model directory with one of `eagle3_target.engines.ENGINES`."""
    check_engine_args(engine, engine_kwargs)
    return ENGINES[engine].load(
        model_path,
        dtype=dtype,
        device=device,
        capture_layer_ids=capture_layer_ids,
        trust_remote_code=trust_remote_code,
        **engine_kwargs,
    )


def check_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    """Refuse, before anything loads, an engine or engine arguments that loading would refuse."""
    if engine not in ENGINES:
        raise ModelRefused(f"unknown engine {engine!r}; expected one of {tuple(ENGINES)}")
    ENGINES[engine].check_args(engine, engine_kwargs)
