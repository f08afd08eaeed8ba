"""What the vLLM runner refuses before vLLM starts, with the reason and `--engine hf` as the way out.

vLLM reports these failures, if at all, only as "engine core initialization failed" from a worker process,
or, for an in-process engine, by waiting forever; checking them first turns each into one clear line at
load. Every check leaves CUDA uninitialised in this process, so vLLM can still fork its workers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transformers import PretrainedConfig

from eagle3_target.runners.base import ModelRefused, logit_transform

# Final norms computed as x * (1 + w) (vLLM's GemmaRMSNorm; transformers' zero-centred RMSNorm), by the
# text config's model_type: the rebuild computes x * w, so these would be served with wrong logits.
ZERO_CENTRED_NORM_MODEL_TYPES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
    }
)


def refuse_unsupported_model(model_path: str, config: PretrainedConfig) -> None:
    """Refuse, before the engine starts, a text config the vLLM runner cannot serve exactly.

    - a logit transform (`logit_transform`): the rebuild is lm_head(final_norm(h_L)) and nothing more;
    - MLA attention (`kv_lora_rank`, vLLM's own rule for both backends: `ModelConfig.use_mla`): vLLM
      0.33's connector cannot find the hidden-states cache group beside MLA's and fails engine start
      ("MLA verifiers are unsupported", `_find_cache_kv_group_id`);
    - a `(1 + w)` final norm (ZERO_CENTRED_NORM_MODEL_TYPES).
    """
    transform = logit_transform(config)
    model_type = getattr(config, "model_type", None)
    if transform is not None:
        reason = f"config.{transform} transforms the logits, which the vLLM runner's logits rebuild omits"
    elif getattr(config, "kv_lora_rank", None) is not None:
        reason = "its MLA attention (config.kv_lora_rank) cannot run beside vLLM 0.33's hidden-states capture"
    elif model_type in ZERO_CENTRED_NORM_MODEL_TYPES:
        reason = f"{model_type} models end in a (1 + w) RMSNorm, which the vLLM runner's logits rebuild omits"
    else:
        return
    raise ModelRefused(f"{model_path}: {reason}; use --engine hf")


def refuse_in_process_engine() -> None:
    """Refuse vLLM's in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

    In-process, the engine steps only inside `generate`, and the connector writes a batch's files in a step
    after its requests finished (pending saves go to the worker with the next step's metadata), so the last
    batch's files would never be written and every read would wait (vLLM 0.33's `InprocClient.get_output`).
    vLLM reads the variable as `bool(int(value))`.
    """
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    try:
        multiprocess = bool(int(value))
    except ValueError:
        raise ModelRefused(f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r} is not an integer") from None
    if not multiprocess:
        raise ModelRefused(
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's engine in this process, where the hidden-states "
            "connector writes a batch's capture files only at the engine's next step, after generate has "
            "returned: the runner would wait for them forever; unset the variable"
        )


def require_eagle3_support(architectures: Sequence[str]) -> None:
    """Fail before starting the engine when vLLM's model class lacks the EAGLE-3 interface.

    vLLM 0.33 decides this in the worker (`supports_eagle3(model)` in
    `GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`, `set_eagle3_aux_hidden_state_layers` for
    MRv2), where the failure surfaces only as "engine core initialization failed"; the same check on the
    registered class here gives the reason. The class is imported in a child process, as vLLM's registry
    inspects classes (its `_run_in_subprocess`: importing a model module may initialise CUDA, and a parent
    with CUDA initialised makes vLLM spawn its workers instead of forking them). Architectures vLLM does not
    register run on its Transformers backend, which implements the interface.
    """
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import _run_in_subprocess

    registered = [a for a in architectures if a in ModelRegistry.get_supported_archs()]
    if not registered:
        return
    model = ModelRegistry.models[registered[0]]
    if not _run_in_subprocess(lambda: supports_eagle3(model.load_model_cls())):
        raise ModelRefused(
            f"vLLM's model class for architecture {registered[0]} does not implement the EAGLE-3 interface "
            "(SupportsEagle3), so extract_hidden_states cannot capture its layers; use --engine hf"
        )
