"""SGLang server arguments: which `--engine-arg KEY=VALUE` the SGLang runner passes on, and what it refuses
before anything loads.

Any of SGLang 0.5.23's own server arguments passes through, parsed by SGLang's own argument parser
(`ServerArgs.add_cli_args`), so values get SGLang's types and checks; an unknown key is refused with the
closest one, keys the runner sets are refused with the reason, and values the capture cannot run with are
refused before SGLang starts. Only the refusals that need a model config import SGLang's model registry.
"""

from __future__ import annotations

import argparse
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch
from transformers import PretrainedConfig

from eagle3_target.runners.base import ModelRefused, logit_transform, parse_dtype, text_config
from eagle3_target.runners.head import resolve_device
from eagle3_target.runners.sglang_rank import use_cpu_engine
from eagle3_target.runners.vllm_args import parse_bool
from eagle3_target.runners.vllm_refusals import ZERO_CENTRED_NORM_MODEL_TYPES

# Server arguments the runner sets itself, each with the reason (user values would break the capture).
RUNNER_OWNED_ARGS: dict[str, str] = {
    "model_path": "pass the model directory to the server (--model)",
    "tokenizer_path": "the runner sends token ids and loads no tokenizer",
    "skip_tokenizer_init": "the runner sends token ids and loads no tokenizer",
    "dtype": "pass the dtype to the server (--dtype)",
    "device": "the runner runs SGLang on the server's device",
    "trust_remote_code": "pass --trust-remote-code",
    "tp_size": "pass --tensor-parallel-size (spec.resources.tensorParallelSize)",
    "context_length": "pass --max-model-len (spec.engine's maxModelLen)",
    "enable_return_aux_hidden_states": "the runner turns on SGLang's aux capture",
    "speculative_algorithm": "the runner names the EAGLE-3 capture convention",
    "return_aux_hidden_state_layer_ids": "the runner sets its capture layers itself (--capture-layer-ids)",
    "speculative_draft_model_path": "the runner captures the target's layers and runs no draft",
    "disable_radix_cache": "the runner keeps SGLang's prefix cache off so every position is computed",
}

# Values SGLang 0.5.23 accepts but the runner cannot serve with, each with the reason.
REFUSED_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "pp_size": (
        lambda size: size > 1,
        "SGLang's aux capture sees only the last pipeline stage's layers (it refuses pp_size > 1 with "
        "--enable-return-aux-hidden-states); use --tensor-parallel-size to spread the model",
    ),
    "dp_size": (
        lambda size: size > 1,
        "the runner drives one model runner in the server's process, with no data-parallel scheduler; run "
        "more replicas (spec.replicas) instead",
    ),
}

# The runner's own options (`SGLangRunner.from_pretrained` keywords given by the server), not SGLang's.
RUNNER_OPTIONS = frozenset({"tensor_parallel_size", "max_model_len", "max_batch_tokens"})

# On SGLang's CPU engine the KV cache is sized in tokens (the GPU share `mem_fraction_static` would ask for
# that share of host memory): a whole batch or one longest row, with room for rounding to pages.
CPU_KV_HEADROOM_TOKENS = 256
# SGLang's attention backend on CPU that needs no CPU kernels (`intel_amx` needs sgl_kernel's ops).
CPU_ATTENTION_BACKEND = "torch_native"


class _Parser(argparse.ArgumentParser):
    """SGLang's argument parser, raising ModelRefused where argparse would print and exit."""

    def error(self, message: str) -> NoReturn:
        raise ModelRefused(f"SGLang refuses the engine arguments: {message}")


@functools.cache
def server_arg_actions() -> dict[str, argparse.Action]:
    """SGLang's server arguments by name (the `ServerArgs` field each flag sets)."""
    parser = _Parser(add_help=False)
    _server_args_class().add_cli_args(parser)
    return {action.dest: action for action in parser._actions if action.option_strings}


def _server_args_class() -> Any:
    # The first SGLang import of a server process that loads on its default device (`resolve_device`).
    use_cpu_engine(resolve_device(None))
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise ModelRefused(
            f"SGLang is not installed in this environment ({exc}); `make setup` installs it in "
            ".venv-sglang (run .venv-sglang/bin/eagle3-target), images build it on SGLang's own image"
        ) from None
    return ServerArgs


def user_flags(engine_kwargs: Mapping[str, object]) -> list[str]:
    """The user's engine arguments as SGLang command-line flags, refused here when unknown (with the
    closest name), owned by the runner, or a value the runner cannot serve with."""
    actions = server_arg_actions()
    flags: list[str] = []
    seen: set[str] = set()
    for raw_key, value in engine_kwargs.items():
        key = raw_key.strip().replace("-", "_")
        if key in RUNNER_OWNED_ARGS:
            raise ModelRefused(
                f"engine argument {raw_key} is set by the SGLang runner: {RUNNER_OWNED_ARGS[key]}"
            )
        if key not in actions:
            close = difflib.get_close_matches(key, [*actions, *RUNNER_OWNED_ARGS], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ModelRefused(
                f"unknown engine argument {raw_key}{hint}: not one of SGLang 0.5.23's server arguments "
                "(python -m sglang.launch_server --help lists them, with - for _)"
            )
        if key in seen:
            raise ModelRefused(f"engine argument {key} given twice")
        seen.add(key)
        action = actions[key]
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch: given when true
            try:
                on = value if isinstance(value, bool) else parse_bool(str(value))
            except ValueError as exc:
                raise ModelRefused(f"engine argument {key}={value!r}: {exc}") from None
            flags += [flag] if on else []
        elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
            flags += [flag, *str(value).replace(",", " ").split()]
        else:
            flags.append(f"{flag}={value}")
    return flags


def refuse_values(namespace: argparse.Namespace, keys: Sequence[str]) -> None:
    for key in keys:
        refused, reason = REFUSED_VALUES.get(key, (None, ""))
        value = getattr(namespace, key, None)
        if refused is not None and value is not None and refused(value):
            raise ModelRefused(
                f"engine argument {key}={value} is not supported by the SGLang runner: {reason}"
            )


def check_engine_args(engine_kwargs: Mapping[str, object]) -> None:
    """Refuse, before anything loads, engine arguments that loading would refuse (`Engine.check_args`)."""
    user = {k: v for k, v in engine_kwargs.items() if k not in RUNNER_OPTIONS}
    namespace = _parse(["--model-path", "unchecked"], user_flags(user))
    refuse_values(namespace, [k.strip().replace("-", "_") for k in user])


def _parse(runner_flags: list[str], flags: list[str]) -> argparse.Namespace:
    parser = _Parser(add_help=False)
    _server_args_class().add_cli_args(parser)
    return parser.parse_args([*runner_flags, *flags])


def sglang_dtype_name(dtype: torch.dtype | str | None) -> str:
    """SGLang's `--dtype` ("auto", "bfloat16", ...) from the dtypes the HF engine also accepts."""
    parsed = parse_dtype("auto" if dtype is None else dtype)
    return parsed if isinstance(parsed, str) else str(parsed).removeprefix("torch.")


def server_args_for(
    model_path: str,
    *,
    dtype: torch.dtype | str | None,
    device: str,
    trust_remote_code: bool,
    max_batch_tokens: int | None,
    engine_kwargs: Mapping[str, object],
) -> Any:
    """SGLang's `ServerArgs`: the runner's flags (aux capture, no tokenizer, no prefix cache, no CUDA graphs:
    an extend runs eagerly and the capture list may change) plus the user's. The capture layers are not
    among them: the runner sets them on the model (`sglang_rank.RankCapture.set_layers`), and SGLang's
    first-forward check of their number against `--return-aux-hidden-state-layer-ids` would fail a capture
    set that changes size or holds the last layer (SGLang cannot capture it; the runner takes it itself)."""
    options = {k: v for k, v in engine_kwargs.items() if k in RUNNER_OPTIONS}
    user = {k: v for k, v in engine_kwargs.items() if k not in RUNNER_OPTIONS}
    flags = user_flags(user)
    keys = [k.strip().replace("-", "_") for k in user]
    runner_flags = [
        "--model-path", model_path,
        "--dtype", sglang_dtype_name(dtype),
        "--device", device,
        "--tp-size", str(options.get("tensor_parallel_size", 1)),
        "--skip-tokenizer-init",
        "--disable-radix-cache",
        "--cuda-graph-backend-decode=disabled",
        "--cuda-graph-backend-prefill=disabled",
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm", "EAGLE3",
    ]  # fmt: skip
    if trust_remote_code:
        runner_flags.append("--trust-remote-code")
    if options.get("max_model_len") is not None:
        runner_flags += ["--context-length", str(options["max_model_len"])]
    if device == "cpu":
        if "attention_backend" not in keys:
            runner_flags += ["--attention-backend", CPU_ATTENTION_BACKEND]
        if "max_total_tokens" not in keys:
            tokens = max(max_batch_tokens or 0, int(str(options.get("max_model_len") or 0)))
            if tokens:
                runner_flags += ["--max-total-tokens", str(tokens + CPU_KV_HEADROOM_TOKENS)]
    namespace = _parse(runner_flags, flags)
    refuse_values(namespace, keys)
    return _server_args_class().from_cli_args(namespace)


def refuse_unsupported_model(model_path: str, full_config: PretrainedConfig) -> None:
    """Refuse, before SGLang loads, a model the SGLang runner cannot serve exactly:

    - an architecture whose SGLang model class has no `set_eagle3_layers_to_capture` (SGLang 0.5.23 fails
      only once the weights are loaded, `configure_aux_hidden_state_capture`);
    - a logit transform (`logit_transform`): SGLang applies it in its logits processor, which the runner
      bypasses for all-position logits (it computes lm_head(final_norm(h_L)));
    - a `(1 + w)` final norm (ZERO_CENTRED_NORM_MODEL_TYPES): trainers given the norm weight apply x * w.
    """
    config = text_config(full_config)
    transform = logit_transform(config)
    model_type = getattr(config, "model_type", None)
    reason: str | None
    if transform is not None:
        reason = f"config.{transform} transforms the logits, which the SGLang runner's logits omit"
    elif model_type in ZERO_CENTRED_NORM_MODEL_TYPES:
        reason = f"{model_type} models end in a (1 + w) RMSNorm, which trainers given its weight would miss"
    else:
        reason = _missing_capture(getattr(full_config, "architectures", None) or [])
    if reason is None:
        return
    raise ModelRefused(f"{model_path}: {reason}; use --engine hf")


def _missing_capture(architectures: Sequence[str]) -> str | None:
    _server_args_class()
    from sglang.srt.models.registry import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    known = [a for a in architectures if a in supported]
    if not known:
        return f"SGLang 0.5.23 has no model class for architectures {list(architectures)}"
    model_class, _ = ModelRegistry.resolve_model_cls(known)
    if not hasattr(model_class, "set_eagle3_layers_to_capture"):
        return f"SGLang's model class for {known[0]} cannot capture EAGLE-3 aux hidden states"
    return None
