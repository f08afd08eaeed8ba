"""A stand-in for the parts of `vllm` 0.33.0 the vLLM runner touches, for CPU tests (vLLM needs a GPU).

It reproduces what the runner can observe, as vLLM's source defines it, and computes the hidden states with
a real transformers forward of the (tiny) checkpoint:
- `engine_start`: `LLM(...)` takes only the keyword arguments 0.33's `LLM`/`EngineArgs` take, validates the
  speculative and connector configs as vLLM does, and fails engine start where vLLM's workers would;
- `llm`: the engine and its `generate`, with the faults tests can cause (a failed, stalled or aborted
  request; transformed logits or captures);
- `connector`: the capture files, locked, written and read as `ExampleHiddenStatesConnector` does;
- `registry`: `ModelRegistry`, `supports_eagle3` and `_run_in_subprocess`, which decide EAGLE-3 support like
  vLLM does and record whether this process imported a model class (`CUDA_STATE`);
- `outputs`: the sampling parameters and request outputs;
- `vllm.platforms.current_platform`: CUDA's (the stand-in is the GPU build; the runner's CPU defaults are
  tested against vLLM's CPU build itself).
`install(monkeypatch)` puts these modules into `sys.modules` under vLLM's module names.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

from support.fake_vllm.connector import cleanup_hidden_states, load_hidden_states
from support.fake_vllm.engine_start import ENGINE_ARGS
from support.fake_vllm.llm import LLM
from support.fake_vllm.outputs import SamplingParams
from support.fake_vllm.registry import (
    CUDA_PLATFORM,
    CUDA_STATE,
    ModelRegistry,
    SupportsEagle3,
    _run_in_subprocess,
    supports_eagle3,
)

__all__ = ["CUDA_STATE", "ENGINE_ARGS", "LLM", "MODULES", "SamplingParams", "install"]

MODULES: dict[str, dict[str, Any]] = {
    "vllm": {"LLM": LLM, "SamplingParams": SamplingParams, "ModelRegistry": ModelRegistry},
    "vllm.distributed": {},
    "vllm.distributed.kv_transfer": {},
    "vllm.distributed.kv_transfer.kv_connector": {},
    "vllm.distributed.kv_transfer.kv_connector.v1": {},
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector": {
        "load_hidden_states": load_hidden_states,
        "cleanup_hidden_states": cleanup_hidden_states,
    },
    "vllm.platforms": {"current_platform": CUDA_PLATFORM},
    "vllm.model_executor": {},
    "vllm.model_executor.models": {"ModelRegistry": ModelRegistry},
    "vllm.model_executor.models.registry": {
        "ModelRegistry": ModelRegistry,
        "_run_in_subprocess": _run_in_subprocess,
    },
    "vllm.model_executor.models.interfaces": {
        "SupportsEagle3": SupportsEagle3,
        "supports_eagle3": supports_eagle3,
    },
}


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shadow any real `vllm` with these modules for the duration of one test."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, attrs in MODULES.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__path__ = []  # a package, so its submodules import
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(LLM, "created", [])
    monkeypatch.setattr(LLM, "capture_fault", None)
    monkeypatch.setattr(LLM, "logit_fault", None)
    monkeypatch.setattr(CUDA_STATE, "initialized", False)
    # vLLM mutates this variable itself (external_launcher); restore it after the test.
    monkeypatch.setenv(
        "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    )
