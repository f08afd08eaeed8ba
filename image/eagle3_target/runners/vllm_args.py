"""vLLM engine arguments: which `--engine-arg KEY=VALUE` the runner passes to `vllm.LLM`, and in what type.

The keys are fields of vLLM 0.33.0's `vllm.EngineArgs`; each comes with the parser that turns its CLI string
into the type vLLM expects, so a typo or a malformed value fails at startup.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from eagle3_target.runners.base import ModelRefused, parse_dtype, parse_positive_int


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def parse_json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def parse_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"expected a fraction in (0, 1], got {text!r}")
    return value


# vLLM 0.33.0's `vllm.EngineArgs` fields accepted through `--engine-arg KEY=VALUE`,
# each with the parser that turns the CLI string into the type vLLM expects.
ENGINE_ARG_PARSERS: dict[str, Callable[[str], Any]] = {
    "gpu_memory_utilization": parse_fraction,
    "kv_cache_memory_bytes": parse_positive_int,
    "max_model_len": parse_positive_int,
    "max_num_seqs": parse_positive_int,
    "max_num_batched_tokens": parse_positive_int,
    "tensor_parallel_size": parse_positive_int,
    "pipeline_parallel_size": parse_positive_int,
    "block_size": parse_positive_int,
    "num_gpu_blocks_override": parse_positive_int,
    "max_cudagraph_capture_size": parse_positive_int,
    "seed": int,
    "cpu_offload_gb": float,
    "quantization": str,
    "kv_cache_dtype": str,
    "load_format": str,
    "revision": str,
    "tokenizer": str,
    "download_dir": str,
    "distributed_executor_backend": str,
    "attention_backend": str,
    "model_impl": str,
    "enforce_eager": parse_bool,
    "enable_chunked_prefill": parse_bool,
    "enable_expert_parallel": parse_bool,
    "disable_custom_all_reduce": parse_bool,
    "async_scheduling": parse_bool,
    "compilation_config": parse_json_object,
    "hf_overrides": parse_json_object,
    "model_loader_extra_config": parse_json_object,
}

# Arguments this runner sets itself: overriding them would break the capture or its correctness.
RUNNER_OWNED_ARGS = {
    "model": "the model path is the runner's first argument",
    "dtype": "pass the dtype to the runner (--dtype)",
    "trust_remote_code": "pass --trust-remote-code",
    "speculative_config": "the runner configures the extract_hidden_states method",
    "kv_transfer_config": "the runner configures the hidden-states connector",
    "enable_prefix_caching": "prefix caching is kept off so every prompt position is computed and captured",
    "skip_tokenizer_init": "the runner sends token ids and reads no text, so vLLM loads no tokenizer",
}

# Values vLLM 0.33 accepts but the capture cannot run with, each with the reason.
REFUSED_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "pipeline_parallel_size": (
        lambda size: size > 1,
        "only the last pipeline stage builds the hidden-states cache layer, and vLLM 0.33's connector "
        "asserts it on every stage (engine start fails); use tensor_parallel_size to spread the model",
    ),
    "model_impl": (
        lambda impl: impl == "transformers",
        "vLLM (0.32 and 0.33) gives the extract_hidden_states draft the target's model_impl, and its "
        "Transformers backend has no ExtractHiddenStatesModel, so the engine cannot start; leave model_impl "
        "at auto (vLLM's own model class) or use --engine hf",
    ),
    "distributed_executor_backend": (
        lambda backend: backend == "external_launcher",
        "it sets VLLM_ENABLE_V1_MULTIPROCESSING=0, an in-process engine that writes a batch's capture files "
        "only at its next step, so the runner would wait for them forever; use mp (the default) or ray",
    ),
}


# Engine arguments that are the runner's own options (`VLLMRunner.from_pretrained` keywords), not vLLM's.
RUNNER_OPTIONS = frozenset({"hidden_states_dir", "capture_timeout_s", "max_batch_tokens"})


def coerce_engine_arg(key: str, value: object) -> Any:
    """One engine argument in the type vLLM expects: CLI strings are parsed, typed values are re-checked."""
    parser = ENGINE_ARG_PARSERS[key]
    text = json.dumps(value) if isinstance(value, dict) else str(value)
    if isinstance(value, bool) and parser is not parse_bool:
        raise ModelRefused(f"engine argument {key}: expected a {parser.__name__} value, got a boolean")
    try:
        return parser(text)
    except ValueError as exc:
        raise ModelRefused(f"engine argument {key}={value!r}: {exc}") from None


def vllm_engine_kwargs(args: Mapping[str, object]) -> dict[str, Any]:
    """Validate and type the user's engine arguments (`--engine-arg KEY=VALUE`, keys with - or _).

    Unknown keys, keys the runner owns and values the capture cannot run with are refused with the reason,
    so a typo fails at startup instead of being silently ignored or reaching vLLM as a string.
    """
    kwargs: dict[str, Any] = {}
    for raw_key, value in args.items():
        key = raw_key.strip().replace("-", "_")
        if key in RUNNER_OWNED_ARGS:
            reason = RUNNER_OWNED_ARGS[key]
            raise ModelRefused(f"engine argument {raw_key} is set by the vLLM runner: {reason}")
        if key not in ENGINE_ARG_PARSERS:
            close = difflib.get_close_matches(key, ENGINE_ARG_PARSERS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ModelRefused(
                f"unknown engine argument {raw_key}{hint}; supported: {', '.join(sorted(ENGINE_ARG_PARSERS))}"
            )
        if key in kwargs:
            raise ModelRefused(f"engine argument {key} given twice")
        kwargs[key] = coerce_engine_arg(key, value)
        refused, reason = REFUSED_VALUES.get(key, (None, ""))
        if refused is not None and refused(kwargs[key]):
            raise ModelRefused(
                f"engine argument {key}={kwargs[key]} is not supported by the vLLM runner: {reason}"
            )
    return kwargs


def vllm_dtype_name(dtype: torch.dtype | str | None) -> str:
    """vLLM's `dtype` argument ("auto", "bfloat16", ...) from the dtypes the HF engine also accepts."""
    parsed = parse_dtype("auto" if dtype is None else dtype)
    return parsed if isinstance(parsed, str) else str(parsed).removeprefix("torch.")
