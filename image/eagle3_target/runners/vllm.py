"""The vLLM engine runner: EAGLE-3 supervision from vLLM 0.33's `extract_hidden_states` speculative method.

vLLM runs the model in its own process and never hands back logits for every position, so this runner asks
vLLM to capture the residual stream at the 3 aux layers plus the final layer (capture id `L`, the hidden
state *before* the final norm). vLLM's `ExampleHiddenStatesConnector` writes one safetensors file per
request; we read it with vLLM's own loader (which waits on the writer's lock), put the layers back in the
requested order, delete the file and rebuild `final_norm(h_L)` and the logits from the checkpoint's final
RMSNorm and LM head. Every vLLM call here was checked against the vLLM 0.33.0 source; `vllm` is imported
lazily so the rest of the package works without it.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import shutil
import tempfile
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from eagle3_target.contract import default_aux_layer_ids, validate_aux_layer_ids
from eagle3_target.runners.base import InvalidInput, check_inputs, logit_transform, text_config
from eagle3_target.runners.checkpoint import HeadWeights, load_head_weights
from eagle3_target.runners.hf import parse_dtype

HIDDEN_STATES_CONNECTOR = "ExampleHiddenStatesConnector"
HIDDEN_STATES_PATH_KEY = "hidden_states_path"
DEFAULT_HIDDEN_STATES_DIR = "/dev/shm"

# Startup check of the logits rebuild against vLLM's own greedy token: prompts, their length, and the share
# that must agree (bf16 kernels differ between the rebuild and vLLM, so near-ties may flip a few).
REBUILD_CHECK_PROMPTS = 8
REBUILD_CHECK_TOKENS = 16
REBUILD_CHECK_MIN_AGREEMENT = 0.75


# ---- engine arguments ---------------------------------------------------------------------------------


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


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


# vllm.EngineArgs fields (vllm/engine/arg_utils.py, 0.33.0) accepted through `--engine-arg KEY=VALUE`,
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
}


def coerce_engine_arg(key: str, value: object) -> Any:
    """One engine argument in the type vLLM expects: CLI strings are parsed, typed values are re-checked."""
    parser = ENGINE_ARG_PARSERS[key]
    text = json.dumps(value) if isinstance(value, dict) else str(value)
    if isinstance(value, bool) and parser is not parse_bool:
        raise ValueError(f"engine argument {key}: expected a {parser.__name__} value, got a boolean")
    try:
        return parser(text)
    except ValueError as exc:
        raise ValueError(f"engine argument {key}={value!r}: {exc}") from None


def vllm_engine_kwargs(args: Mapping[str, object]) -> dict[str, Any]:
    """Validate and type the user's engine arguments (`--engine-arg KEY=VALUE`, keys with - or _).

    Unknown keys and keys the runner owns are refused with the reason, so a typo fails at startup instead
    of being silently ignored or reaching vLLM as a string.
    """
    kwargs: dict[str, Any] = {}
    for raw_key, value in args.items():
        key = raw_key.strip().replace("-", "_")
        if key in RUNNER_OWNED_ARGS:
            raise ValueError(f"engine argument {raw_key} is set by the vLLM runner: {RUNNER_OWNED_ARGS[key]}")
        if key not in ENGINE_ARG_PARSERS:
            close = difflib.get_close_matches(key, ENGINE_ARG_PARSERS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"unknown engine argument {raw_key}{hint}; supported: {', '.join(sorted(ENGINE_ARG_PARSERS))}"
            )
        if key in kwargs:
            raise ValueError(f"engine argument {key} given twice")
        kwargs[key] = coerce_engine_arg(key, value)
    return kwargs


# ---- capture layout -----------------------------------------------------------------------------------


def capture_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM capture ids for HF aux ids: id `k` is the residual entering layer `k`, so HF `a` -> `a+1`; plus L.

    Aux id `L-1` would capture `L`, the final pre-norm state asked for separately; vLLM dedups the ids and
    the file would hold one layer fewer, so it is refused.
    """
    ids = validate_aux_layer_ids(aux_layer_ids, num_layers)
    if num_layers - 1 in ids:
        raise ValueError(
            f"aux layer id {num_layers - 1} (the last decoder layer) is not supported by the vLLM engine: "
            f"its capture id {num_layers} is the final pre-norm hidden state the runner already captures"
        )
    return [a + 1 for a in ids] + [num_layers]


def file_positions(capture_ids: Sequence[int]) -> list[int]:
    """Index of each capture id in vLLM's file, which holds the layers ascending (`tuple(sorted(set(ids)))`
    in `EagleModelMixin._set_aux_hidden_state_layers`, vllm/model_executor/models/interfaces.py)."""
    ascending = sorted(capture_ids)
    return [ascending.index(i) for i in capture_ids]


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The final RMSNorm exactly as transformers' Llama/Qwen3 RMSNorm computes it (fp32 statistics)."""
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def check_capture(
    row: int, data: Mapping[str, Tensor], prompt: list[int], num_captures: int, hidden: int
) -> Tensor:
    """Refuse a capture that would make wrong supervision: wrong shape/length, foreign tokens, zeros, NaN/inf.

    All-zero layers are what vLLM 0.24 silently wrote for hybrid models (vllm PR #46301); a length mismatch
    is what prefix caching produced in vllm issue #44485.
    """
    states = data["hidden_states"]
    token_ids = data["token_ids"]
    if states.dim() != 3 or tuple(states.shape[1:]) != (num_captures, hidden):
        raise RuntimeError(
            f"row {row}: captured hidden_states has shape {tuple(states.shape)}, expected "
            f"[seq, {num_captures}, {hidden}]"
        )
    if states.shape[0] != len(prompt) or token_ids.numel() != len(prompt):
        raise RuntimeError(
            f"row {row}: vLLM captured {states.shape[0]} positions ({token_ids.numel()} token ids) for a "
            f"{len(prompt)}-token prompt"
        )
    if token_ids.tolist() != prompt:
        raise RuntimeError(f"row {row}: the captured token_ids differ from the prompt that was sent")
    if not torch.isfinite(states).all():
        raise RuntimeError(f"row {row}: vLLM captured non-finite (NaN/inf) hidden states")
    zero_layers = (states == 0).flatten(start_dim=2).all(dim=2).all(dim=0).nonzero().flatten().tolist()
    if zero_layers:
        raise RuntimeError(f"row {row}: vLLM captured all-zero hidden states at file slot(s) {zero_layers}")
    return states


def discard_capture(path: str) -> None:
    """Delete a capture file without reading it, once its writer has finished.

    The connector writes asynchronously while holding LOCK_EX on `path + ".lock"` (created before the path
    is returned); deleting before the write ends would let the file reappear afterwards and stay in memory.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    with contextlib.suppress(FileNotFoundError), open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    cleanup_hidden_states(path)


def require_eagle3_support(architectures: Sequence[str]) -> None:
    """Fail before starting the engine when vLLM's model class lacks the EAGLE-3 interface.

    vLLM decides this in the worker (`supports_eagle3(model)` in `_setup_eagle3_aux_hidden_state_outputs`,
    vllm/v1/worker/gpu_model_runner.py, and `set_eagle3_aux_hidden_state_layers` for MRv2), where the
    failure surfaces only as "engine core initialization failed"; the same check on the registered class
    here gives the reason. Architectures vLLM does not register run on its Transformers backend, which
    implements the interface.
    """
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    registered = [a for a in architectures if a in ModelRegistry.get_supported_archs()]
    if not registered:
        return
    model_cls = ModelRegistry.models[registered[0]].load_model_cls()
    if not supports_eagle3(model_cls):
        raise ValueError(
            f"vLLM's {model_cls.__name__} (architecture {registered[0]}) does not implement the EAGLE-3 "
            "interface (SupportsEagle3), so extract_hidden_states cannot capture its layers; use --engine hf"
        )


def vllm_dtype_name(dtype: torch.dtype | str | None) -> str:
    """vLLM's `dtype` argument ("auto", "bfloat16", ...) from the dtypes the HF engine also accepts."""
    parsed = parse_dtype("auto" if dtype is None else dtype)
    return parsed if isinstance(parsed, str) else str(parsed).removeprefix("torch.")


# ---- the runner ---------------------------------------------------------------------------------------


class TargetHead(nn.Module):
    """The runner's `model`: the config plus the frozen output-side weights held outside vLLM.

    The real model lives in vLLM's engine process; callers only need `.config` and `.parameters()` (for
    the device and dtype), which this gives them with weights that exist.
    """

    def __init__(self, config: PretrainedConfig, weights: HeadWeights) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(weights.input_embeddings, requires_grad=False)
        self.norm = nn.Parameter(weights.final_norm, requires_grad=False)
        self.lm_head = nn.Parameter(weights.lm_head, requires_grad=False)


class VLLMRunner:
    """`TargetRunner` over an offline `vllm.LLM`; one `generate` call per batch, ragged rows."""

    def __init__(
        self,
        model_path: str,
        config: PretrainedConfig,
        aux_layer_ids: Sequence[int],
        dtype_name: str,
        device: torch.device,
        hidden_states_dir: Path,
        trust_remote_code: bool,
        engine_kwargs: dict[str, Any],
    ) -> None:
        self._model_path = model_path
        self._config = config
        self._dtype_name = dtype_name
        self._device = device
        self._hidden_states_dir = hidden_states_dir
        self._trust_remote_code = trust_remote_code
        self._engine_kwargs = engine_kwargs
        self._llm: Any = None
        self._sampling_params: Any = None
        self._aux_layer_ids: list[int] = []
        self._capture_ids: list[int] = []
        self._head: TargetHead | None = None
        self.set_aux_layers(aux_layer_ids)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
        hidden_states_dir: str | Path = DEFAULT_HIDDEN_STATES_DIR,
        **engine_kwargs: object,
    ) -> VLLMRunner:
        """Start the engine. `hidden_states_dir` should be memory-backed: every request's capture passes
        through it as a file. `engine_kwargs` are vLLM engine arguments (see `vllm_engine_kwargs`)."""
        model_path = str(model_path)
        typed_kwargs = vllm_engine_kwargs(engine_kwargs)
        full_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        config = text_config(full_config)
        transform = logit_transform(config)
        if transform is not None:
            raise ValueError(
                f"{model_path}: config.{transform} transforms the logits, which the vLLM runner's logits "
                "rebuild does not reproduce; use --engine hf"
            )
        require_eagle3_support(getattr(full_config, "architectures", None) or [])
        ids = default_aux_layer_ids(config.num_hidden_layers) if aux_layer_ids is None else aux_layer_ids
        Path(hidden_states_dir).mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix="eagle3-target-", dir=hidden_states_dir))
        resolved_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            return cls(
                model_path,
                config,
                ids,
                vllm_dtype_name(dtype),
                resolved_device,
                run_dir,
                trust_remote_code,
                typed_kwargs,
            )
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    # -- engine lifecycle --

    def engine_config(self, capture_ids: Sequence[int]) -> dict[str, Any]:
        """Everything `vllm.LLM` receives besides the user's engine arguments.

        Keys as read in vLLM 0.33: `SpeculativeConfig.__post_init__` (method, num_speculative_tokens == 1,
        `draft_model_config["hf_config"]`), `KVTransferConfig` (connector name, a role is required) and the
        connector's `shared_storage_path` extra key.
        """
        return {
            "model": self._model_path,
            "dtype": self._dtype_name,
            "trust_remote_code": self._trust_remote_code,
            "enable_prefix_caching": False,
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture_ids)}},
            },
            "kv_transfer_config": {
                "kv_connector": HIDDEN_STATES_CONNECTOR,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self._hidden_states_dir)},
            },
        }

    def start_engine(self, capture_ids: list[int]) -> None:
        """(Re)start vLLM capturing `capture_ids`; the engine is stopped again if its startup check fails."""
        from vllm import LLM, SamplingParams

        self.stop_engine()
        self._llm = LLM(**self.engine_config(capture_ids), **self._engine_kwargs)
        self._capture_ids = capture_ids
        self._aux_layer_ids = [c - 1 for c in capture_ids[:-1]]
        # One greedy token: the capture covers the prompt; generating more would only cost time.
        self._sampling_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            if self._head is None:
                # After the engine starts, so CUDA is not initialised before vLLM forks its workers.
                weights = load_head_weights(
                    self._model_path,
                    vocab_size=self._config.vocab_size,
                    hidden_size=self._config.hidden_size,
                    tie_word_embeddings=bool(getattr(self._config, "tie_word_embeddings", False)),
                    dtype=self._llm.model_config.dtype,
                    device=self._device,
                )
                self._head = TargetHead(self._config, weights)
            self.check_logits_rebuild()
        except BaseException:
            self.stop_engine()
            raise

    def check_logits_rebuild(self) -> None:
        """The rebuilt logits must pick the token vLLM sampled greedily from its own logits.

        A model whose final norm or head differs from the rebuild (a `(1 + w)` RMSNorm, a logit scale, a
        capture id `L` that is not the true final state) fails here, at startup, instead of serving wrong
        supervision.
        """
        gen = torch.Generator().manual_seed(0)
        length = min(REBUILD_CHECK_TOKENS, self.max_prompt_len)
        prompts = torch.randint(0, self._config.vocab_size, (REBUILD_CHECK_PROMPTS, length), generator=gen)
        agreeing = 0
        with contextlib.closing(self.capture(prompts.tolist())) as captures:
            for states, sampled in captures:
                last = states[-1:, -1].to(device=self._device, dtype=self.model.norm.dtype)
                logits = F.linear(
                    rms_norm(last, self.model.norm, self._config.rms_norm_eps), self.model.lm_head
                )
                agreeing += int(logits.argmax(dim=-1).item() == sampled)
        if agreeing < REBUILD_CHECK_MIN_AGREEMENT * REBUILD_CHECK_PROMPTS:
            raise RuntimeError(
                f"the logits rebuilt from vLLM's captured final hidden state pick vLLM's own greedy token "
                f"for only {agreeing} of {REBUILD_CHECK_PROMPTS} prompts: this model's final norm or LM head "
                "is not the Llama-style one the vLLM runner reproduces; use --engine hf"
            )

    def stop_engine(self) -> None:
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None

    def close(self) -> None:
        """Stop the engine and remove this runner's capture directory."""
        self.stop_engine()
        shutil.rmtree(self._hidden_states_dir, ignore_errors=True)

    # -- TargetRunner surface --

    @property
    def model(self) -> TargetHead:
        assert self._head is not None
        return self._head

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self._aux_layer_ids)

    @property
    def hidden_states_dir(self) -> Path:
        return self._hidden_states_dir

    @property
    def max_prompt_len(self) -> int:
        """Longest row vLLM accepts (`InputProcessor._validate_model_input`: the prompt plus the one
        generated token must fit in max_model_len), which also keeps every row inside the capture
        (`_input_fits_in_drafter` skips the capture of a batch whose longest row + 1 exceeds it)."""
        return int(self._llm.model_config.max_model_len) - 1

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Select the aux layers. vLLM fixes capture layers at engine start, so a change restarts it."""
        capture_ids = capture_layer_ids(aux_layer_ids, self._config.num_hidden_layers)
        if capture_ids == self._capture_ids and self._llm is not None:
            return
        self.start_engine(capture_ids)

    def input_embedding_weight(self) -> Tensor:
        return self.model.embed_tokens.detach()

    def lm_head_weight(self) -> Tensor:
        return self.model.lm_head.detach()

    def final_norm_weight(self) -> Tensor:
        return self.model.norm.detach()

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(final_norm(h_L) [B,S,H], aux [B,S,3H]) unshifted; padding positions are zeros."""
        ids, mask = check_inputs(input_ids, attention_mask, self._config.vocab_size)
        lengths = mask.sum(dim=1).tolist()
        if max(lengths) > self.max_prompt_len:
            raise InvalidInput(
                f"a row has {max(lengths)} tokens; the vLLM engine takes at most {self.max_prompt_len} "
                "(max_model_len - 1: the generated token needs one slot)"
            )
        batch, seq = ids.shape
        hidden = self._config.hidden_size
        dtype = self.model.norm.dtype
        final = torch.zeros(batch, seq, hidden, dtype=dtype, device=self._device)
        aux = torch.zeros(batch, seq, len(self._aux_layer_ids) * hidden, dtype=dtype, device=self._device)
        prompts = [ids[r, : lengths[r]].tolist() for r in range(batch)]
        with contextlib.closing(self.capture(prompts)) as captures:
            for r, (prompt, (states, _)) in enumerate(zip(prompts, captures, strict=True)):
                states = states.to(device=self._device, dtype=dtype)
                n = len(prompt)
                aux[r, :n] = states[:, : len(self._aux_layer_ids)].flatten(start_dim=1)
                final[r, :n] = rms_norm(states[:, -1], self.model.norm, self._config.rms_norm_eps)
        return final, aux

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B,S,V] = lm_head(final_norm(h_L)), aux [B,S,3H]) unshifted."""
        final, aux = self.forward_hidden(input_ids, attention_mask)
        return F.linear(final, self.model.lm_head), aux

    def capture(self, prompts: list[list[int]]) -> Generator[tuple[Tensor, int]]:
        """Run the prompts as one `generate` call; yield, in request order, each row's [n, 3+1, H] states
        (aux in the requested order, then h_L) and the token vLLM sampled after it. Every row's file is
        gone once the generator is closed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        outputs = self._llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self._sampling_params, use_tqdm=False
        )
        paths = [(out.kv_transfer_params or {}).get(HIDDEN_STATES_PATH_KEY) for out in outputs]
        sampled = [out.outputs[0].token_ids[0] for out in outputs]
        order = file_positions(self._capture_ids)
        try:
            for row, (prompt, path, token) in enumerate(zip(prompts, paths, sampled, strict=True)):
                if path is None:
                    raise RuntimeError(
                        f"row {row}: vLLM returned no {HIDDEN_STATES_PATH_KEY} (is the hidden-states "
                        "connector configured?)"
                    )
                data = load_hidden_states(path)
                cleanup_hidden_states(path)
                states = check_capture(row, data, prompt, len(order), self._config.hidden_size)
                yield states[:, order], token
        finally:
            # A failed row must not leave the other rows' files behind in shared memory.
            for path in paths:
                if path is not None:
                    discard_capture(path)
