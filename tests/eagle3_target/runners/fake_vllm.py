"""A stand-in for the parts of `vllm` 0.33.0 the vLLM runner touches, for CPU tests (vLLM needs a GPU).

It reproduces what the runner can observe, as vLLM's source defines it, and computes the hidden states with
a real transformers forward of the (tiny) checkpoint:
- `LLM(...)` validates the arguments the way vLLM's configs do and records what it received;
- `generate` captures, per request, the residual stream entering each capture layer (id 0 = embeddings,
  id L = final pre-norm state), ascending, and writes it through the same file protocol as
  `ExampleHiddenStatesConnector`: a lock file taken exclusively before the output is returned, an
  asynchronous `save_file` of `hidden_states` [n, n_capture, H] and `token_ids` [n] int64, the lock released
  after the write, and the path under `kv_transfer_params["hidden_states_path"]`;
- `load_hidden_states` / `cleanup_hidden_states` are the connector module's own helpers;
- `ModelRegistry` + `supports_eagle3` decide EAGLE-3 support like vLLM does (a runtime-checkable protocol).
`install(monkeypatch)` puts these modules into `sys.modules` under vLLM's module names.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import secrets
import sys
import time
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoModelForCausalLM


# ---- vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py ------------------
def load_hidden_states(path: str) -> dict[str, Tensor]:
    """Module helper `load_hidden_states`: a shared flock on `path + ".lock"` (sleeps until the writer
    releases LOCK_EX), then `safetensors.torch.load_file(path, device="cpu")`."""
    with open(path + ".lock") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_SH)
        return load_file(path, device="cpu")


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False) -> None:
    """Module helper `cleanup_hidden_states`: removes the lock file, then (unless kept) the file."""
    lock_path = path + ".lock"
    if os.path.exists(lock_path):
        os.remove(lock_path)
    if not keep_hidden_states and os.path.exists(path):
        os.remove(path)


# ---- vllm/model_executor/models/interfaces.py and registry.py -----------------------------------------
@runtime_checkable
class SupportsEagle3(Protocol):
    """`SupportsEagle3` (with `SupportsEagleBase`'s members): vLLM checks it with isinstance."""

    has_own_lm_head: bool = False
    has_own_embed_tokens: bool = False
    supports_eagle3: ClassVar[Literal[True]] = True

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None: ...


def supports_eagle3(model: object) -> bool:
    return isinstance(model, SupportsEagle3)


class LlamaForCausalLM(SupportsEagle3):
    """vLLM's llama.py class implements SupportsEagle3."""


class Qwen3ForCausalLM(SupportsEagle3):
    """vLLM's qwen3.py class implements SupportsEagle3."""


class Gemma3ForCausalLM:
    """vLLM 0.33's gemma3.py class does not implement SupportsEagle3."""


@dataclass(frozen=True)
class RegisteredModel:
    model_cls: type

    def load_model_cls(self) -> type:
        return self.model_cls


@dataclass
class _ModelRegistry:
    models: dict[str, RegisteredModel] = field(
        default_factory=lambda: {
            cls.__name__: RegisteredModel(cls)
            for cls in (LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM)
        }
    )

    def get_supported_archs(self) -> set[str]:
        return set(self.models)


ModelRegistry = _ModelRegistry()


# ---- vllm/sampling_params.py and vllm/outputs.py ------------------------------------------------------
@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    kv_transfer_params: dict[str, Any] | None


# ---- vllm/entrypoints/llm.py ---------------------------------------------------------------------------
class EngineCoreClient:
    def __init__(self) -> None:
        self.running = True

    def shutdown(self, timeout: float | None = None) -> None:
        self.running = False


def resolve_auto_dtype(config_dtype: torch.dtype | None) -> torch.dtype:
    """`_resolve_auto_dtype` (vllm/config/model.py): the checkpoint's dtype, fp32 downcast to bf16."""
    if config_dtype is None or config_dtype == torch.float32:
        return torch.bfloat16
    return config_dtype


class LLM:
    """Offline engine. Each `generate` call is one scheduler batch of pure prefills (max_tokens=1)."""

    created: ClassVar[list[LLM]] = []
    # Test hook: rewrites (hidden_states, token_ids) before they are written, to reproduce engine faults.
    capture_fault: ClassVar[Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None] = None

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        speculative_config: dict[str, Any] | None = None,
        kv_transfer_config: dict[str, Any] | None = None,
        enable_prefix_caching: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.init_kwargs = {
            "model": model,
            "dtype": dtype,
            "trust_remote_code": trust_remote_code,
            "tensor_parallel_size": tensor_parallel_size,
            "speculative_config": speculative_config,
            "kv_transfer_config": kv_transfer_config,
            "enable_prefix_caching": enable_prefix_caching,
            **kwargs,
        }
        kv = dict(kv_transfer_config or {})
        if kv.get("kv_connector") is not None and kv.get("kv_role") is None:
            # KVTransferConfig.__post_init__ (vllm/config/kv_transfer.py)
            raise ValueError("Please specify kv_role when kv_connector is set")
        if kv.get("kv_connector") != "ExampleHiddenStatesConnector" or speculative_config is None:
            raise AssertionError(
                "ExampleHiddenStatesConnector only works with the extract_hidden_states method"
            )
        if speculative_config.get("method") != "extract_hidden_states":
            raise ValueError(f"unsupported speculative method {speculative_config.get('method')!r}")
        # ExtractHiddenStatesProposer.__init__ (vllm/v1/spec_decode/extract_hidden_states.py)
        assert speculative_config.get("num_speculative_tokens") == 1
        hf_config = speculative_config.get("draft_model_config", {}).get("hf_config", {})
        # EagleModelMixin._set_aux_hidden_state_layers (vllm/model_executor/models/interfaces.py)
        self.capture_layers = tuple(sorted(set(hf_config["eagle_aux_hidden_state_layer_ids"])))
        self.storage_path = kv.get("kv_connector_extra_config", {}).get("shared_storage_path", "/tmp")

        hf_model = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=trust_remote_code)
        arch = hf_model.config.architectures[0]
        if not supports_eagle3(ModelRegistry.models[arch].load_model_cls()):
            # GPUModelRunner._setup_eagle3_aux_hidden_state_outputs (vllm/v1/worker/gpu_model_runner.py)
            raise RuntimeError(
                "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
            )
        resolved = resolve_auto_dtype(hf_model.config.dtype) if dtype == "auto" else getattr(torch, dtype)
        self.hf_model = hf_model.to(resolved).eval()
        # ModelConfig.max_model_len: the engine argument, else derived from the checkpoint's config.
        max_model_len = kwargs.get("max_model_len") or hf_model.config.max_position_embeddings
        self.model_config = types.SimpleNamespace(dtype=resolved, max_model_len=max_model_len)
        self.llm_engine = types.SimpleNamespace(engine_core=EngineCoreClient())
        self.request_counter = itertools.count()
        self.writer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="vllm-hs-save")
        self.write_delay_s = 0.0
        LLM.created.append(self)

    def capture(self, prompts: list[list[int]]) -> list[tuple[Tensor, int]]:
        """Each request's captured states [n, n_capture, H] ascending by capture id, and its next token.

        Capture id k is `hidden_states + residual` entering decoder layer k (llama.py `LlamaModel.forward`
        calls `_maybe_add_hidden_state` before layer 0 and after each layer); id L is taken before
        `self.norm`. In transformers, `hidden_states[k]` (k < L) is that same residual stream and the
        final norm's input is the pre-norm state. Requests of equal length share one unpadded forward.
        """
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        num_layers = self.hf_model.config.num_hidden_layers
        results: dict[int, tuple[Tensor, int]] = {}
        for indices in by_length.values():
            out, pre_norm = self.forward(torch.tensor([prompts[i] for i in indices]))
            layers = [pre_norm if k == num_layers else out.hidden_states[k] for k in self.capture_layers]
            stacked = torch.stack(layers, dim=2)  # [rows, n, n_capture, H]
            for row, i in enumerate(indices):
                results[i] = (stacked[row].clone(), int(out.logits[row, -1].argmax()))
        return [results[i] for i in range(len(prompts))]

    def forward(self, input_ids: Tensor) -> tuple[Any, Tensor]:
        """A transformers forward with all hidden states, plus the final norm's input (the pre-norm state)."""
        pre_norm: list[Tensor] = []
        hook = self.hf_model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
        try:
            with torch.no_grad():
                out = self.hf_model(input_ids, output_hidden_states=True)
        finally:
            hook.remove()
        return out, pre_norm[0]

    def write(self, filename: str, lock_fd: int, tensors: dict[str, Tensor]) -> None:
        """`ExampleHiddenStatesConnector._write_tensors`: save, then close the fd holding LOCK_EX."""
        try:
            if self.write_delay_s:
                # Stands in for the copy-stream event wait, so the file appears after generate returns.
                time.sleep(self.write_delay_s)
            save_file(tensors, filename)
        finally:
            os.close(lock_fd)

    def generate(
        self,
        prompts: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if not self.llm_engine.engine_core.running:
            raise RuntimeError("the engine core has shut down")
        token_lists = [list(prompt["prompt_token_ids"]) for prompt in prompts]
        for token_ids in token_lists:
            # InputProcessor._validate_model_input (vllm/v1/engine/input_processor.py)
            if len(token_ids) >= self.model_config.max_model_len:
                raise ValueError(
                    f"The decoder prompt (length {len(token_ids)}) plus the number of requested output "
                    "tokens (at least 1) is longer than the maximum model length"
                )
        outputs = []
        for token_ids, (states, next_token) in zip(token_lists, self.capture(token_lists), strict=True):
            # LLM._add_request: external id = the counter; InputProcessor.assign_request_id appends a suffix.
            request_id = str(next(self.request_counter))
            internal_id = f"{request_id}-{secrets.token_hex(4)}"
            filename = os.path.join(self.storage_path, f"{internal_id}.safetensors")
            # wait_for_save: the lock exists and is held before the client sees the path.
            os.makedirs(os.path.dirname(filename), exist_ok=True)
            lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            # request_finished: token_ids = torch.tensor(request.prompt_token_ids) (int64)
            ids_tensor = torch.tensor(token_ids)
            if LLM.capture_fault is not None:
                states, ids_tensor = LLM.capture_fault(states, ids_tensor)
            tensors = {"hidden_states": states.contiguous(), "token_ids": ids_tensor}
            self.writer.submit(self.write, filename, lock_fd, tensors)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=token_ids,
                    outputs=[CompletionOutput(index=0, text="", token_ids=[next_token])],
                    finished=True,
                    kv_transfer_params={"hidden_states_path": filename},
                )
            )
        # OfflineInferenceMixin._run_engine returns outputs sorted by int(request_id).
        return sorted(outputs, key=lambda o: int(o.request_id))


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
    "vllm.model_executor": {},
    "vllm.model_executor.models": {"ModelRegistry": ModelRegistry},
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
