"""The vLLM engine runner: EAGLE-3 supervision from vLLM 0.33's `extract_hidden_states` speculative method.

vLLM runs the model in its own process and never hands back logits for every position, so this runner asks
vLLM to capture the residual stream at the 3 aux layers plus the final layer (capture id `L`, the hidden
state *before* the final norm). vLLM's `ExampleHiddenStatesConnector` writes one safetensors file per
request; we read it once its writer's lock is free (with a bound), put the layers back in the requested
order, delete the file and rebuild `final_norm(h_L)` and the logits from the checkpoint's final RMSNorm and
LM head. Every vLLM call here was checked against the vLLM 0.33.0 source (docs/vllm.md describes the
behaviour relied on); `vllm` is imported lazily so the rest of the package works without it. Engine
arguments are in `vllm_args`, the capture layout and file protocol in `vllm_capture`, and what is refused
before the engine starts in `vllm_refusals`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from eagle3_target.contract import default_aux_layer_ids
from eagle3_target.runners.base import (
    InvalidInput,
    ModelRefused,
    check_inputs,
    parse_max_batch_tokens,
    refuse_batches_beyond_cache,
    text_config,
)
from eagle3_target.runners.checkpoint import HeadWeights, load_head_weights
from eagle3_target.runners.vllm_args import vllm_dtype_name, vllm_engine_kwargs
from eagle3_target.runners.vllm_capture import (
    HIDDEN_STATES_CONNECTOR,
    HIDDEN_STATES_PATH_KEY,
    capture_layer_ids,
    check_capture,
    compare_logprobs,
    discard_capture,
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

# Startup check of the logits rebuild against vLLM's own logits at each prompt's last position: prompts,
# their length, the share of greedy tokens that must agree (bf16 kernels differ between the rebuild and
# vLLM, so near-ties may flip a few), how many of vLLM's top log-probabilities are compared (vLLM's default
# max_logprobs), the largest difference allowed (bf16 differences are ~0.1) and how far from 1 the scale
# between the two may be (a logit scale keeps every greedy token; `compare_logprobs`).
REBUILD_CHECK_PROMPTS = 8
REBUILD_CHECK_TOKENS = 16
REBUILD_CHECK_MIN_AGREEMENT = 0.75
REBUILD_CHECK_LOGPROBS = 20
REBUILD_CHECK_MAX_LOGPROB_DIFF = 1.0
REBUILD_CHECK_MAX_SCALE_ERROR = 0.05


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
        full_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        config = text_config(full_config)
        refuse_unsupported_model(model_path, config)
        require_eagle3_support(getattr(full_config, "architectures", None) or [])
        ids = default_aux_layer_ids(config.num_hidden_layers) if aux_layer_ids is None else aux_layer_ids
        dtype_name = vllm_dtype_name(dtype)
        batch_tokens = parse_max_batch_tokens(max_batch_tokens)
        typed_kwargs = with_cpu_defaults(typed_kwargs, config, dtype_name, batch_tokens)
        Path(hidden_states_dir).mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix="eagle3-target-", dir=hidden_states_dir))
        resolved_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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

    def engine_config(self, capture_ids: Sequence[int]) -> dict[str, Any]:
        """Everything `vllm.LLM` receives besides the user's engine arguments.

        Keys as read in vLLM 0.33: `SpeculativeConfig.__post_init__` (method; the
        `draft_model_config["hf_config"]` keys override the wrapped target config), whose proposer (V1) or
        speculator (MRv2, the default runner) requires num_speculative_tokens == 1; `KVTransferConfig`
        (connector name, a role is required) and the connector's `shared_storage_path` extra key. The
        capture ids go sorted: native model classes write the layers ascending whatever the order, the
        Transformers backend in the order given. No tokenizer is loaded: the runner sends token ids and
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
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(capture_ids)}
                },
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
            refuse_batches_beyond_cache(
                self._max_batch_tokens,
                self.kv_cache_tokens,
                "raise the engine argument gpu_memory_utilization (kv_cache_memory_bytes on CPU)",
            )
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
        """The logits rebuilt from the captured final state must be vLLM's own, in value, not only argmax.

        At each check prompt's last position vLLM samples greedily and returns its top log-probabilities
        (`logprobs_mode="raw_logprobs"`, the default: the model's logits before any sampling processing).
        A model whose final norm or head differs from the rebuild (a `(1 + w)` RMSNorm, a logit scale, a
        capture id `L` that is not the true final state) fails here, at startup, instead of serving wrong
        supervision; a scale keeps every greedy token, so the log-probabilities are compared too.
        """
        from vllm import SamplingParams

        gen = torch.Generator().manual_seed(0)
        length = min(REBUILD_CHECK_TOKENS, self.max_prompt_len)
        prompts = torch.randint(0, self._config.vocab_size, (REBUILD_CHECK_PROMPTS, length), generator=gen)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, logprobs=REBUILD_CHECK_LOGPROBS
        )
        agreeing = 0
        rebuilt: list[Tensor] = []
        engine: list[Tensor] = []
        with contextlib.closing(self.capture(prompts.tolist(), params)) as captures:
            for states, completion in captures:
                last = states[-1:, -1].to(device=self._device, dtype=self.model.norm.dtype)
                normed = rms_norm(last, self.model.norm, self._config.rms_norm_eps)
                logits = F.linear(normed, self.model.lm_head)[0].float()
                agreeing += int(logits.argmax().item() == completion.token_ids[0])
                top = completion.logprobs[0]
                rebuilt.append(torch.log_softmax(logits, dim=-1)[list(top)].cpu())
                engine.append(torch.tensor([lp.logprob for lp in top.values()], dtype=torch.float64))
        scale, max_diff = compare_logprobs(rebuilt, engine)
        if (
            agreeing < REBUILD_CHECK_MIN_AGREEMENT * REBUILD_CHECK_PROMPTS
            or max_diff > REBUILD_CHECK_MAX_LOGPROB_DIFF
            or abs(scale - 1) > REBUILD_CHECK_MAX_SCALE_ERROR
        ):
            raise ModelRefused(
                "the logits rebuilt from vLLM's captured final hidden state are not vLLM's own: they pick "
                f"vLLM's greedy token for {agreeing} of {REBUILD_CHECK_PROMPTS} prompts (at least "
                f"{REBUILD_CHECK_MIN_AGREEMENT:.0%} needed), their log-probabilities differ from vLLM's by "
                f"up to {max_diff:.3f} (at most {REBUILD_CHECK_MAX_LOGPROB_DIFF} allowed), and vLLM's logits "
                f"are {scale:.3f} times the rebuilt ones (1 ± {REBUILD_CHECK_MAX_SCALE_ERROR} allowed): this "
                "model's final norm or LM head is not the Llama-style one the vLLM runner reproduces; use "
                "--engine hf"
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
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(final_norm(h_L) [B,S,H], aux [B,S,3H]) unshifted; padding positions are zeros.

        With `prenorm`, h_L as captured (capture id L is the residual before the final norm)."""
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
                last = states[:, -1]
                final[r, :n] = last if prenorm else rms_norm(last, self.model.norm, self._config.rms_norm_eps)
        return final, aux

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B,S,V] = lm_head(final_norm(h_L)), aux [B,S,3H]) unshifted."""
        final, aux = self.forward_hidden(input_ids, attention_mask)
        return F.linear(final, self.model.lm_head), aux

    def capture(self, prompts: list[list[int]], params: Any = None) -> Generator[tuple[Tensor, Any]]:
        """Run the prompts as one `generate` call; yield, in request order, each row's [n, 3+1, H] states
        (aux in the requested order, then h_L) and vLLM's `CompletionOutput` for it (the greedy token, and
        log-probabilities when `params` asks for them). Every row's file is gone once the generator is
        closed, or, if its write has not ended by then, once a later call finds it ended."""
        for unfinished in list(self._unfinished):
            if discard_capture(unfinished, timeout_s=0):
                self._unfinished.discard(unfinished)
        outputs = self._llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params or self._sampling_params, use_tqdm=False
        )
        paths = [(out.kv_transfer_params or {}).get(HIDDEN_STATES_PATH_KEY) for out in outputs]
        order = file_positions(self._capture_ids)
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
                states = check_capture(row, data, prompt, len(order), self._config.hidden_size)
                yield states[:, order], completion
        finally:
            # A failed row must not leave the other rows' files behind in shared memory.
            for leftover in paths:
                if leftover is not None and not discard_capture(
                    leftover, 0 if leftover in late else self._capture_timeout_s
                ):
                    self._unfinished.add(leftover)
