"""The one registry of engines. Torch-free, so the CLI, the server's settings and the operator can read it
without loading an engine; each engine's code is imported only when it is checked or loaded.

Adding an engine: a runner module under `eagle3_target.runners`, its name in `EngineName` and one `ENGINES`
entry. A test checks the CRD's `spec.engine` enum (and the operator's spec, which takes `EngineName`) against
this table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from eagle3_target.runners.base import TargetRunner


def _load_hf(model_path: str | os.PathLike[str], **kwargs: Any) -> TargetRunner:
    from eagle3_target.runners.hf import HFRunner

    return HFRunner.from_pretrained(model_path, **kwargs)


def _load_vllm(model_path: str | os.PathLike[str], **kwargs: Any) -> TargetRunner:
    from eagle3_target.runners.vllm import VLLMRunner

    return VLLMRunner.from_pretrained(os.fspath(model_path), **kwargs)


def _load_sglang(model_path: str | os.PathLike[str], **kwargs: Any) -> TargetRunner:
    from eagle3_target.runners.sglang import SGLangRunner

    return SGLangRunner.from_pretrained(model_path, **kwargs)


def _no_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    from eagle3_target.runners.base import ModelRefused

    if engine_kwargs:
        raise ModelRefused(
            f"the {engine} engine takes no engine arguments, got {sorted(engine_kwargs)}: drop the "
            "--engine-arg flags (they are vLLM's or SGLang's) or use --engine vllm or sglang"
        )


def _vllm_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    from eagle3_target.runners.vllm_args import RUNNER_OPTIONS, vllm_engine_kwargs

    vllm_engine_kwargs({key: value for key, value in engine_kwargs.items() if key not in RUNNER_OPTIONS})


def _sglang_engine_args(engine: str, engine_kwargs: Mapping[str, object]) -> None:
    from eagle3_target.runners.sglang_args import check_engine_args

    check_engine_args(engine_kwargs)


@dataclass(frozen=True)
class Engine:
    """One engine: how to load its runner and what it accepts."""

    # (model_path, dtype=, device=, capture_layer_ids=, trust_remote_code=, **engine_kwargs) -> runner
    load: Callable[..., TargetRunner]
    # Refuses, before anything loads, the engine arguments that loading would refuse (ModelRefused).
    check_args: Callable[[str, Mapping[str, object]], None]
    # Spreads a model over `tensor_parallel_size` GPUs (so needs at least one) and honours `max_model_len`;
    # otherwise one device, CPU included.
    sharded: bool
    # What /readyz says while the engine loads.
    loading_message: str = "loading weights"
    # The server image that has this engine installed: its variant of the release (the tag's suffix);
    # the default image (vLLM's) serves every engine without one.
    image_variant: str = ""


# Static, for typed settings and the operator's spec; a test checks it names exactly the ENGINES entries.
EngineName = Literal["vllm", "sglang", "hf"]
# The first entry is the default.
ENGINES: dict[str, Engine] = {
    "vllm": Engine(
        _load_vllm,
        _vllm_engine_args,
        sharded=True,
        loading_message="starting the vLLM engine (loading weights, compiling, capturing CUDA graphs)",
    ),
    "sglang": Engine(
        _load_sglang,
        _sglang_engine_args,
        sharded=True,
        loading_message="starting the SGLang model runner (loading weights, allocating the KV cache)",
        image_variant="sglang",
    ),
    "hf": Engine(_load_hf, _no_engine_args, sharded=False),
}
DEFAULT_ENGINE = next(iter(ENGINES))
