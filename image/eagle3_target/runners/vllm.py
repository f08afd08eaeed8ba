"""The vLLM engine runner: EAGLE-3 supervision from vLLM 0.33's `extract_hidden_states` speculative method.

vLLM runs the model in its own process and never hands back logits for every position, so this runner asks
vLLM to capture the residual stream at the capture set's layers plus the final layer (capture id `L`, the
hidden state *before* the final norm, which is also HF layer id L-1). vLLM's `ExampleHiddenStatesConnector`
writes one safetensors file per request; we read it once its writer's lock is free (with a bound), put the
layers in the capture set's order, delete the file and rebuild `final_norm(h_L)` and the logits from the
checkpoint's final RMSNorm and LM head (`head`). Every vLLM call here was checked against the vLLM 0.33.0
source (docs/vllm.md describes the behaviour relied on); `vllm` is imported lazily so the rest of the
package works without it. Engine arguments are in `vllm_args`, the capture layout, file protocol and
startup check of the rebuilt logits in `vllm_capture`, and what is refused before the engine starts in
`vllm_refusals`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from eagle3_target.contract import default_aux_layer_ids, validate_capture_layer_ids
from eagle3_target.runners.base import (
    ModelRefused,
    parse_max_batch_tokens,
    refuse_batches_beyond_cache,
)
from eagle3_target.runners.head import RebuiltHeadRunner, TargetHead, read_config, resolve_device
from eagle3_target.runners.vllm_args import vllm_dtype_name, vllm_engine_kwargs
from eagle3_target.runners.vllm_capture import (
    HIDDEN_STATES_CONNECTOR,
    HIDDEN_STATES_PATH_KEY,
    check_capture,
    check_logits_rebuild,
    discard_capture,
    engine_capture_ids,
    file_positions,
    read_capture,
    rms_norm,
)
from eagle3_target.runners.vllm_cpu import with_cpu_defaults
from eagle3_target.runners.vllm_refusals import (
    refuse_in_process_engine,
    refuse_unsupported_model,
    require_eagle3_support,
)

DEFAULT_HIDDEN_STATES_DIR = "/dev/shm"

# Longest wait for a capture file's writer (seconds; runner option `capture_timeout_s`). The write starts a
# step after `generate` returns and takes well under a second per GiB on /dev/shm; a wait this long means
# the engine process is stuck or gone, and the request fails (500) instead of hanging the server.
DEFAULT_CAPTURE_TIMEOUT_S = 60.0


class VLLMRunner(RebuiltHeadRunner):
    """`TargetRunner` over an offline `vllm.LLM`; one `generate` call per batch, ragged rows."""

    ENGINE = "vLLM"
    PROMPT_LIMIT = "max_model_len - 1: the generated token needs one slot"

    def __init__(
        self,
        model_path: str,
        config: PretrainedConfig,
        capture_layer_ids: Sequence[int],
        dtype_name: str,
        device: torch.device,
        hidden_states_dir: Path,
        trust_remote_code: bool,
        engine_kwargs: dict[str, Any],
        capture_timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S,
        max_batch_tokens: int | None = None,
    ) -> None:
        self._model_path = model_path
        self._config = config
        self._dtype_name = dtype_name
        self._device = device
        self._hidden_states_dir = hidden_states_dir
        self._trust_remote_code = trust_remote_code
        self._engine_kwargs = engine_kwargs
        self._capture_timeout_s = capture_timeout_s
        self._max_batch_tokens = max_batch_tokens
        # Capture files whose write had not ended when their batch was done; removed by later batches.
        self._unfinished: set[str] = set()
        self._llm: Any = None
        self._sampling_params: Any = None
        self._capture_layer_ids: list[int] = []
        self._engine_ids: list[int] = []  # vLLM's capture ids, ascending (`engine_capture_ids`)
        self._positions: list[int] = []  # the file slot of each captured layer, in capture-set order
        self._head: TargetHead | None = None
        self.set_capture_layers(capture_layer_ids)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        capture_layer_ids: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
        hidden_states_dir: str | Path = DEFAULT_HIDDEN_STATES_DIR,
        capture_timeout_s: float | str = DEFAULT_CAPTURE_TIMEOUT_S,
        max_batch_tokens: int | str | None = None,
        **engine_kwargs: object,
    ) -> VLLMRunner:
        """Start the engine. `hidden_states_dir` should be memory-backed: every request's capture passes
        through it as a file; `capture_timeout_s` bounds the wait for one file's write; `max_batch_tokens`
        (the server's) sizes the KV cache on vLLM's CPU platform, and must fit in the one vLLM allocates.
        `engine_kwargs` are vLLM engine arguments (see `vllm_engine_kwargs`). Everything that can be refused
        is refused before the engine starts, with CUDA left uninitialised in this process."""
        model_path = str(model_path)
        typed_kwargs = vllm_engine_kwargs(engine_kwargs)
        try:
            timeout_s = float(capture_timeout_s)
        except ValueError:
            raise ModelRefused(
                f"capture_timeout_s={capture_timeout_s!r} is not a number of seconds"
            ) from None
        if not timeout_s > 0:
            raise ModelRefused(f"capture_timeout_s must be positive, got {capture_timeout_s!r}")
        refuse_in_process_engine()
        full_config, config = read_config(model_path, trust_remote_code)
        refuse_unsupported_model(model_path, config)
        require_eagle3_support(getattr(full_config, "architectures", None) or [])
        ids = (
            default_aux_layer_ids(config.num_hidden_layers)
            if capture_layer_ids is None
            else capture_layer_ids
        )
        dtype_name = vllm_dtype_name(dtype)
        batch_tokens = parse_max_batch_tokens(max_batch_tokens)
        typed_kwargs = with_cpu_defaults(typed_kwargs, config, dtype_name, batch_tokens)
        Path(hidden_states_dir).mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix="eagle3-target-", dir=hidden_states_dir))
        resolved_device = resolve_device(device)
        try:
            return cls(
                model_path,
                config,
                ids,
                dtype_name,
                resolved_device,
                run_dir,
                trust_remote_code,
                typed_kwargs,
                timeout_s,
                batch_tokens,
            )
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    # -- engine lifecycle --

    def engine_config(self, engine_ids: Sequence[int]) -> dict[str, Any]:
        """Everything `vllm.LLM` receives besides the user's engine arguments.

        Keys as read in vLLM 0.33: `SpeculativeConfig.__post_init__` (method; the
        `draft_model_config["hf_config"]` keys override the wrapped target config), whose proposer (V1) or
        speculator (MRv2, the default runner) requires num_speculative_tokens == 1; `KVTransferConfig`
        (connector name, a role is required) and the connector's `shared_storage_path` extra key. The
        capture ids go sorted (`engine_capture_ids`). No tokenizer is loaded: the runner sends token ids and
        reads no text.
        """
        return {
            "model": self._model_path,
            "dtype": self._dtype_name,
            "trust_remote_code": self._trust_remote_code,
            "skip_tokenizer_init": True,
            "enable_prefix_caching": False,
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(engine_ids)}},
            },
            "kv_transfer_config": {
                "kv_connector": HIDDEN_STATES_CONNECTOR,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self._hidden_states_dir)},
            },
        }

    def start_engine(self, engine_ids: list[int]) -> None:
        """(Re)start vLLM capturing `engine_ids` (vLLM's capture ids, ascending); the engine is stopped again
        if its startup check fails."""
        from vllm import LLM, SamplingParams

        self.stop_engine()
        self._llm = LLM(**self.engine_config(engine_ids), **self._engine_kwargs)
        self._engine_ids = engine_ids
        # One greedy token: the capture covers the prompt; generating more would only cost time.
        self._sampling_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        try:
            refuse_batches_beyond_cache(
                self._max_batch_tokens,
                self.kv_cache_tokens,
                "raise the engine argument gpu_memory_utilization (kv_cache_memory_bytes on CPU)",
            )
            if self._head is None:
                # After the engine starts, so CUDA is not initialised before vLLM forks its workers.
                dtype = self._llm.model_config.dtype
                self._head = TargetHead.load(self._model_path, self._config, dtype, self._device)
            check_logits_rebuild(self.capture, self.model, self.max_prompt_len)
        except BaseException:
            self.stop_engine()
            raise

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
    def engine(self) -> Any:
        """The running `vllm.LLM`, for inspection (its `llm_engine.vllm_config` says what vLLM runs with)."""
        return self._llm

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens vLLM's KV cache holds at once, as its engine core allocated it and handed back at start:
        vLLM's own count across its KV cache groups (`kv_cache_size_tokens`, what it logs as "KV cache
        size"), else its blocks times their size."""
        cache = self._llm.llm_engine.vllm_config.cache_config
        counted = getattr(cache, "kv_cache_size_tokens", None)
        return int(counted) if counted else int(cache.num_gpu_blocks) * int(cache.block_size)

    @property
    def failure(self) -> str | None:
        """vLLM marks its client dead when the engine core process exits (a worker failed, or a batch raised
        in the engine: vLLM ends its engine core then); every later `generate` raises EngineDeadError."""
        if self._llm is None:
            return "the vLLM engine is not running (closed, or its restart failed)"
        if self._llm.llm_engine.engine_core.resources.engine_dead:
            return "vLLM's engine core has exited (the log above it says why); vLLM does not restart it"
        return None

    @property
    def hidden_states_dir(self) -> Path:
        return self._hidden_states_dir

    @property
    def max_prompt_len(self) -> int:
        """Longest row vLLM accepts (`InputProcessor._validate_prompt_len`: the prompt plus the one
        generated token must fit in max_model_len). On the V1 model runner this also keeps every row
        inside the capture (`_input_fits_in_drafter` skips a batch whose longest row + 1 exceeds it)."""
        return int(self._llm.model_config.max_model_len) - 1

    def set_capture_layers(self, capture_layer_ids: Sequence[int]) -> None:
        """Capture these layers. vLLM fixes its capture layers at engine start, so a set that needs other
        vLLM capture ids restarts it (the same layers in another order do not)."""
        ids = validate_capture_layer_ids(capture_layer_ids, self._config.num_hidden_layers)
        engine_ids = engine_capture_ids(ids, self._config.num_hidden_layers)
        if engine_ids != self._engine_ids or self._llm is None:
            self.start_engine(engine_ids)
        self._capture_layer_ids = ids
        self._positions = file_positions(ids, engine_ids)

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(final_norm(h_L) [B,S,H], captured [B,S,n*H]) unshifted; padding positions are zeros. With
        `prenorm`, h_L as captured (capture id L is the residual before the final norm)."""
        rows = self.rows(input_ids, attention_mask)
        with contextlib.closing(self.capture(rows.prompts)) as captures:
            states = torch.cat([row_states for row_states, _ in captures])  # [tokens, slots, H]
        states = states.to(device=self._device, dtype=self.model.norm.dtype)
        final = states[:, -1]
        if not prenorm:
            final = rms_norm(final, self.model.norm, self._config.rms_norm_eps)
        captured = states[:, self._positions].flatten(start_dim=1)
        return self.unpack(rows, final), self.unpack(rows, captured)

    def capture(self, prompts: list[list[int]], params: Any = None) -> Generator[tuple[Tensor, Any]]:
        """Run the prompts as one `generate` call; yield, in request order, each row's [n, slots, H] states
        (vLLM's capture ids ascending: h_L last) and vLLM's `CompletionOutput` for it (the greedy token, and
        log-probabilities when `params` asks for them). Every row's file is gone once the generator is
        closed, or, if its write has not ended by then, once a later call finds it ended."""
        for unfinished in list(self._unfinished):
            if discard_capture(unfinished, timeout_s=0):
                self._unfinished.discard(unfinished)
        outputs = self._llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params or self._sampling_params, use_tqdm=False
        )
        paths = [(out.kv_transfer_params or {}).get(HIDDEN_STATES_PATH_KEY) for out in outputs]
        late: set[str] = set()  # files whose write outlasted the wait: not waited for again below
        try:
            for row, (prompt, path, out) in enumerate(zip(prompts, paths, outputs, strict=True)):
                if path is None:
                    raise RuntimeError(
                        f"row {row}: vLLM returned no {HIDDEN_STATES_PATH_KEY} (is the hidden-states "
                        "connector configured?)"
                    )
                completion = out.outputs[0]
                if not completion.token_ids:
                    raise RuntimeError(
                        f"row {row}: vLLM returned no token (finish reason: {completion.finish_reason})"
                    )
                late.add(path)
                data = read_capture(row, path, self._capture_timeout_s)
                late.discard(path)
                states = check_capture(row, data, prompt, len(self._engine_ids), self._config.hidden_size)
                yield states, completion
        finally:
            # A failed row must not leave the other rows' files behind in shared memory.
            for leftover in paths:
                if leftover is not None and not discard_capture(
                    leftover, 0 if leftover in late else self._capture_timeout_s
                ):
                    self._unfinished.add(leftover)
