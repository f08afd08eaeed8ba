"""What building `vllm.LLM(...)` checks in vLLM 0.33, in vLLM's order and with its messages: the keyword
arguments (only `EngineArgs`' fields, listed from the 0.33 wheel in vllm_0_33_engine_args.txt), the
speculative and connector configs, and the failures of the workers at engine start (pipeline parallelism,
MLA, a class without the EAGLE-3 interface, duplicate capture ids), which the parent sees only as
"engine core initialization failed".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from support.fake_vllm.registry import ModelRegistry, supports_eagle3

# vllm.LLM's keyword arguments in 0.33.0 (generated from the wheel; see the file's header).
ENGINE_ARGS = frozenset(
    line
    for line in (Path(__file__).with_name("vllm_0_33_engine_args.txt").read_text().splitlines())
    if line and not line.startswith("#")
)


# What vLLM says when `model_impl=transformers` meets `extract_hidden_states` (real vLLM's wording, checked
# by tests/support/test_fake_vllm_against_vllm.py).
TRANSFORMERS_BACKEND_FAILURE = (
    "Cannot find model module. 'ExtractHiddenStatesModel' is not a registered model in the Transformers "
    "library (only relevant if the model is meant to be in Transformers)"
)


@dataclass(frozen=True)
class CaptureConfig:
    """What the configs ask the engine to capture: the capture ids as given, and where the files go."""

    layer_ids: list[int]
    storage_path: str


def check_configs(kwargs: Mapping[str, Any]) -> CaptureConfig:
    """The keyword arguments and the configs built from them, refused as vLLM refuses them before any
    worker starts."""
    unknown = sorted(set(kwargs) - ENGINE_ARGS)
    if unknown:
        # LLM.__init__ forwards **kwargs to EngineArgs(...), a dataclass.
        raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{unknown[0]}'")
    kv = dict(kwargs.get("kv_transfer_config") or {})
    if kv.get("kv_connector") is not None and kv.get("kv_role") is None:
        # KVTransferConfig.__post_init__
        raise ValueError("Please specify kv_role when kv_connector is set")
    speculative_config = kwargs.get("speculative_config")
    if kv.get("kv_connector") != "ExampleHiddenStatesConnector" or speculative_config is None:
        raise AssertionError(
            "ExampleHiddenStatesConnector only works when using 'extract_hidden_states' speculative method"
        )
    if speculative_config.get("method") != "extract_hidden_states":
        raise ValueError(f"unsupported speculative method {speculative_config.get('method')!r}")
    if kwargs.get("model_impl") == "transformers":
        # SpeculativeConfig gives the draft the target's model_impl; the registry then resolves the draft's
        # ExtractHiddenStatesModel in transformers (a pydantic ValidationError, a ValueError, in vLLM).
        raise ValueError(TRANSFORMERS_BACKEND_FAILURE)
    if speculative_config.get("num_speculative_tokens") != 1:
        # ExtractHiddenStatesSpeculator.__init__ (Model Runner V2)
        raise ValueError("extract_hidden_states requires num_speculative_tokens to be 1")
    hf_config = speculative_config.get("draft_model_config", {}).get("hf_config", {})
    layer_ids = list(hf_config.get("eagle_aux_hidden_state_layer_ids") or [])
    if not layer_ids:
        # The proposer's __init__, in the worker (ExtractHiddenStatesProposer / ...Speculator).
        raise engine_core_failed(
            "eagle_aux_hidden_state_layer_ids must be set in the draft model config for "
            "extract_hidden_states method"
        )
    storage_path = kv.get("kv_connector_extra_config", {}).get("shared_storage_path", "/tmp")
    return CaptureConfig(layer_ids, storage_path)


def engine_core_failed(cause: str) -> RuntimeError:
    """What the parent sees when a worker fails during engine start (the cause is only in the log)."""
    return RuntimeError(f"Engine core initialization failed. See root cause above. ({cause})")


def start_workers(
    kwargs: Mapping[str, Any], config: PretrainedConfig, layer_ids: list[int]
) -> tuple[str, tuple[int, ...]]:
    """The backend the workers run the model on ("vllm" for a registered class, else "transformers") and
    the capture layers as that backend stores them; or the failure with which a worker ends engine start."""
    arch = config.architectures[0]
    registered = arch in ModelRegistry.models
    backend = "vllm" if registered else "transformers"
    if backend == "vllm" and not supports_eagle3(ModelRegistry.models[arch].model_cls):
        # GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
        raise engine_core_failed(
            "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
        )
    # Native classes: EagleModelMixin._set_aux_hidden_state_layers, tuple(sorted(set(layers))). The
    # Transformers backend: TransformersBase.set_aux_hidden_state_layers, one recorder per id in the order
    # given (a dict).
    capture_layers = tuple(sorted(set(layer_ids))) if backend == "vllm" else tuple(dict.fromkeys(layer_ids))
    if len(capture_layers) != len(layer_ids):
        # ExtractHiddenStatesSpeculator.propose (Model Runner V2); V1 fails on the buffer's shape instead.
        raise engine_core_failed(
            f"Expected {len(layer_ids)} auxiliary hidden states, got {len(capture_layers)}"
        )
    if int(kwargs.get("pipeline_parallel_size") or 1) > 1:
        # Only the last PP rank builds the CacheOnlyAttentionLayer; the connector's worker side asserts.
        raise engine_core_failed("AssertionError: Expected 1 CacheOnlyAttentionLayer, got 0")
    if getattr(config, "kv_lora_rank", None) is not None:
        # ExampleHiddenStatesConnector._find_cache_kv_group_id
        raise engine_core_failed(
            "Could not uniquely identify the extract-hidden-states KV cache group; the hidden-states "
            "layer must be isolated in its own group (MLA verifiers are unsupported)."
        )
    return backend, capture_layers


def resolve_auto_dtype(config_dtype: torch.dtype | None) -> torch.dtype:
    """`vllm.config.model._resolve_auto_dtype`: the checkpoint's dtype, fp32 downcast to bf16."""
    if config_dtype is None or config_dtype == torch.float32:
        return torch.bfloat16
    return config_dtype
