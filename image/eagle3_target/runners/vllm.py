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
from eagle3_target.runners.base import InvalidInput, ModelRefused, check_inputs, logit_transform, text_config
from eagle3_target.runners.checkpoint import HeadWeights, load_head_weights
from eagle3_target.runners.vllm_args import vllm_dtype_name, vllm_engine_kwargs
from eagle3_target.runners.vllm_capture import (
    HIDDEN_STATES_CONNECTOR,
    HIDDEN_STATES_PATH_KEY,
    capture_layer_ids,
    check_capture,
    discard_capture,
    file_positions,
    rms_norm,
)

DEFAULT_HIDDEN_STATES_DIR = "/dev/shm"

# Startup check of the logits rebuild against vLLM's own greedy token: prompts, their length, and the share
# that must agree (bf16 kernels differ between the rebuild and vLLM, so near-ties may flip a few).
REBUILD_CHECK_PROMPTS = 8
REBUILD_CHECK_TOKENS = 16
REBUILD_CHECK_MIN_AGREEMENT = 0.75


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
        raise ModelRefused(
            f"vLLM's {model_cls.__name__} (architecture {registered[0]}) does not implement the EAGLE-3 "
            "interface (SupportsEagle3), so extract_hidden_states cannot capture its layers; use --engine hf"
        )


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
            raise ModelRefused(
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
