"""Target runners and the one registry of engines. Engines import lazily, so the package works where vLLM
(or CUDA) is absent.

Adding an engine: a runner module plus one `ENGINES` entry. The server's settings and CLI choices read
`ENGINES`; a test checks the CRD's enum against it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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


def _no_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    if engine_kwargs:
        raise ModelRefused(
            f"the {engine} engine takes no engine arguments, got {sorted(engine_kwargs)}: drop the "
            "--engine-arg flags (they are vLLM's) or use --engine vllm"
        )


def _load_hf(model_path: str | os.PathLike[str], **kwargs: Any) -> TargetRunner:
    from eagle3_target.runners.hf import HFRunner

    return HFRunner.from_pretrained(model_path, **kwargs)


def _load_vllm(model_path: str | os.PathLike[str], **kwargs: Any) -> TargetRunner:
    from eagle3_target.runners.vllm import VLLMRunner

    return VLLMRunner.from_pretrained(model_path, **kwargs)


def _vllm_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    from eagle3_target.runners.vllm_args import RUNNER_OPTIONS, vllm_engine_kwargs

    vllm_engine_kwargs({key: value for key, value in engine_kwargs.items() if key not in RUNNER_OPTIONS})


@dataclass(frozen=True)
class Engine:
    """One engine: how to load its runner (importing the engine only then) and what it accepts."""

    # (model_path, dtype=, device=, aux_layer_ids=, trust_remote_code=, **engine_kwargs) -> runner
    load: Callable[..., TargetRunner]
    # Refuses, before anything loads, the engine arguments that loading would refuse.
    check_args: Callable[[str, Mapping[str, object]], None]
    # Spreads a model over `tensor_parallel_size` devices and honours `max_model_len`; otherwise one device.
    sharded: bool


# The first entry is the default.
ENGINES: dict[str, Engine] = {
    "vllm": Engine(_load_vllm, _vllm_engine_args, sharded=True),
    "hf": Engine(_load_hf, _no_engine_args, sharded=False),
}
DEFAULT_ENGINE = next(iter(ENGINES))

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "Engine",
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
    """Load a local model directory with one of `ENGINES`."""
    check_engine_args(engine, engine_kwargs)
    return ENGINES[engine].load(
        model_path,
        dtype=dtype,
        device=device,
        aux_layer_ids=aux_layer_ids,
        trust_remote_code=trust_remote_code,
        **engine_kwargs,
    )


def check_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    """Refuse, before anything loads, an engine or engine arguments that loading would refuse."""
    if engine not in ENGINES:
        raise ModelRefused(f"unknown engine {engine!r}; expected one of {tuple(ENGINES)}")
    ENGINES[engine].check_args(engine, engine_kwargs)
