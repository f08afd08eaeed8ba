"""A stand-in for the parts of `vllm` 0.33.0 the vLLM runner touches, for CPU tests (vLLM needs a GPU).

It reproduces what the runner can observe, as vLLM's source defines it, and computes the hidden states with
a real transformers forward of the (tiny) checkpoint:
- `LLM(...)` takes only the keyword arguments 0.33's `LLM`/`EngineArgs` take (vllm_0_33_engine_args.txt),
  validates the speculative and connector configs as vLLM does, and fails engine start where vLLM's workers
  would (pipeline parallelism, MLA, a class without the EAGLE-3 interface, duplicate capture ids);
- `generate` captures, per request, the residual stream entering each capture layer (id L = final pre-norm
  state). Native model classes write the layers ascending; the Transformers backend (`model_impl=
  "transformers"`, or an architecture vLLM does not register) writes them in the order given;
- the file protocol is `ExampleHiddenStatesConnector`'s: the lock is taken exclusively in the step that
  schedules the request (before the output is returned); the write happens one engine step after the
  request finished, in a writer thread, and releases the lock. In multiprocess mode the engine core keeps
  stepping after `generate` returns; in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) the next step is the
  next `generate` call, so reading a batch's files right after its `generate` blocks forever;
- tests can make a write fail (lock released, no file), stall (lock never released), or abort a request
  (no token, file still written), and transform vLLM's logits (`logit_fault`) or captures (`capture_fault`);
- `load_hidden_states` / `cleanup_hidden_states` are the connector module's own helpers;
- `ModelRegistry` + `supports_eagle3` decide EAGLE-3 support like vLLM does; importing a model class marks
  CUDA initialised in that process (`CUDA_STATE`), and `_run_in_subprocess` runs a function in a child.
`install(monkeypatch)` puts these modules into `sys.modules` under vLLM's module names.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import pickle
import secrets
import sys
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoModelForCausalLM

# vllm.LLM's keyword arguments in 0.33.0 (generated from the wheel; see the file's header).
ENGINE_ARGS = frozenset(
    line
    for line in (Path(__file__).with_name("vllm_0_33_engine_args.txt").read_text().splitlines())
    if line and not line.startswith("#")
)
# Seconds one engine step takes in the stand-in: the delay between a request finishing and its write.
STEP_S = 0.02

_T = TypeVar("_T")


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
@dataclass
class CudaState:
    """Whether this process has initialised CUDA (`torch.cuda.is_initialized()` on a GPU machine)."""

    initialized: bool = False


CUDA_STATE = CudaState()


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


class DeepseekV3ForCausalLM(SupportsEagle3):
    """vLLM's deepseek_v2.py class implements SupportsEagle3 (and uses MLA attention)."""


class Gemma3ForCausalLM:
    """vLLM 0.33's gemma3.py class does not implement SupportsEagle3."""


@dataclass(frozen=True)
class RegisteredModel:
    model_cls: type

    def load_model_cls(self) -> type:
        # Importing a vLLM model module may initialise CUDA; vLLM inspects classes in a subprocess for that
        # reason (`_LazyRegisteredModel.inspect_model_cls`, registry.py:1122).
        CUDA_STATE.initialized = True
        return self.model_cls


@dataclass
class _ModelRegistry:
    models: dict[str, RegisteredModel] = field(
        default_factory=lambda: {
            cls.__name__: RegisteredModel(cls)
            for cls in (LlamaForCausalLM, Qwen3ForCausalLM, DeepseekV3ForCausalLM, Gemma3ForCausalLM)
        }
    )

    def get_supported_archs(self) -> set[str]:
        return set(self.models)


ModelRegistry = _ModelRegistry()


def _run_in_subprocess(fn: Callable[[], _T]) -> _T:
    """registry.py `_run_in_subprocess`: runs `fn` in a child process and returns its pickled result
    (vLLM starts `python -m vllm.model_executor.models.registry`; a fork keeps the stand-in installed)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the result, leave without running the parent's exit handlers
        os.close(read_fd)
        try:
            payload = pickle.dumps((True, fn()))
        except BaseException as exc:  # reported to the parent, as vLLM reports the child's stderr
            payload = pickle.dumps((False, repr(exc)))
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    ok, result = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"Error raised in subprocess:\n{result}")
    return result


# ---- vllm/sampling_params.py, vllm/logprobs.py and vllm/outputs.py -----------------------------------
@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    detokenize: bool = True
    logprobs: int | None = None
    extra_args: dict[str, Any] | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    kv_transfer_params: dict[str, Any] | None


# ---- vllm/entrypoints/llm.py and the engine behind it ---------------------------------------------------
class EngineCoreClient:
    def __init__(self, on_shutdown: Callable[[], None]) -> None:
        self.running = True
        self.on_shutdown = on_shutdown

    def shutdown(self, timeout: float | None = None) -> None:
        self.running = False
        self.on_shutdown()


def resolve_auto_dtype(config_dtype: torch.dtype | None) -> torch.dtype:
    """`_resolve_auto_dtype` (vllm/config/model.py): the checkpoint's dtype, fp32 downcast to bf16."""
    if config_dtype is None or config_dtype == torch.float32:
        return torch.bfloat16
    return config_dtype


def engine_core_failed(cause: str) -> RuntimeError:
    """What the parent sees when a worker fails during engine start (the cause is only in the log)."""
    return RuntimeError(f"Engine core initialization failed. See root cause above. ({cause})")


@dataclass
class PendingSave:
    """`PendingSave`: a finished request whose states the worker writes in a later step."""

    filename: str
    lock_fd: int
    tensors: dict[str, Tensor]
    fail: bool = False
    stall: bool = False


class LLM:
    """Offline engine. Each `generate` call is one scheduler batch of pure prefills (max_tokens=1)."""

    created: ClassVar[list[LLM]] = []
    # Test hooks, set before the engine starts (its startup check runs at once): rewrite (hidden_states,
    # token_ids) before they are written, or vLLM's logits before sampling, to reproduce engine faults.
    capture_fault: ClassVar[Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None] = None
    logit_fault: ClassVar[Callable[[Tensor], Tensor] | None] = None

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - ENGINE_ARGS)
        if unknown:
            # LLM.__init__ forwards **kwargs to EngineArgs(...), a dataclass.
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{unknown[0]}'")
        self.init_kwargs = {"model": model, **kwargs}
        kv = dict(kwargs.get("kv_transfer_config") or {})
        if kv.get("kv_connector") is not None and kv.get("kv_role") is None:
            # KVTransferConfig.__post_init__ (vllm/config/kv_transfer.py)
            raise ValueError("Please specify kv_role when kv_connector is set")
        speculative_config = kwargs.get("speculative_config")
        if kv.get("kv_connector") != "ExampleHiddenStatesConnector" or speculative_config is None:
            raise AssertionError(
                "ExampleHiddenStatesConnector only works when using "
                "'extract_hidden_states' speculative method"
            )
        if speculative_config.get("method") != "extract_hidden_states":
            raise ValueError(f"unsupported speculative method {speculative_config.get('method')!r}")
        if speculative_config.get("num_speculative_tokens") != 1:
            # ExtractHiddenStatesSpeculator.__init__ (MRv2, vllm/v1/worker/gpu/spec_decode/)
            raise ValueError("extract_hidden_states requires num_speculative_tokens to be 1")
        hf_config = speculative_config.get("draft_model_config", {}).get("hf_config", {})
        layer_ids = list(hf_config.get("eagle_aux_hidden_state_layer_ids") or [])
        if not layer_ids:
            raise ValueError(
                "eagle_aux_hidden_state_layer_ids must be set in the draft model config for "
                "extract_hidden_states method"
            )
        self.storage_path = kv.get("kv_connector_extra_config", {}).get("shared_storage_path", "/tmp")

        hf_model = AutoModelForCausalLM.from_pretrained(
            model, trust_remote_code=kwargs.get("trust_remote_code")
        )
        arch = hf_model.config.architectures[0]
        registered = arch in ModelRegistry.models
        self.backend = (
            "transformers" if kwargs.get("model_impl") == "transformers" or not registered else "vllm"
        )
        if self.backend == "vllm" and not supports_eagle3(ModelRegistry.models[arch].model_cls):
            # GPUModelRunner._setup_eagle3_aux_hidden_state_outputs (vllm/v1/worker/gpu_model_runner.py)
            raise engine_core_failed(
                "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
            )
        if self.backend == "vllm":
            # EagleModelMixin._set_aux_hidden_state_layers: tuple(sorted(set(layers)))
            self.capture_layers = tuple(sorted(set(layer_ids)))
        else:
            # TransformersBase.set_aux_hidden_state_layers: one recorder per id, in the order given (a dict)
            self.capture_layers = tuple(dict.fromkeys(layer_ids))
        if len(self.capture_layers) != len(layer_ids):
            # ExtractHiddenStatesSpeculator.propose (MRv2); V1 fails on the buffer's shape instead.
            raise engine_core_failed(
                f"Expected {len(layer_ids)} auxiliary hidden states, got {len(self.capture_layers)}"
            )
        if int(kwargs.get("pipeline_parallel_size") or 1) > 1:
            # Only the last PP rank builds the CacheOnlyAttentionLayer; the connector's worker side asserts.
            raise engine_core_failed("AssertionError: Expected 1 CacheOnlyAttentionLayer, got 0")
        if getattr(hf_model.config, "kv_lora_rank", None) is not None:
            # ExampleHiddenStatesConnector._find_cache_kv_group_id
            raise engine_core_failed(
                "Could not uniquely identify the extract-hidden-states KV cache group; the hidden-states "
                "layer must be isolated in its own group (MLA verifiers are unsupported)."
            )
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # ParallelConfig.__post_init__ does this
        # envs.VLLM_ENABLE_V1_MULTIPROCESSING: bool(int(os.getenv(..., "1")))
        self.multiprocess = bool(int(os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")))
        resolved = (
            resolve_auto_dtype(hf_model.config.dtype)
            if kwargs.get("dtype", "auto") == "auto"
            else getattr(torch, kwargs["dtype"])
        )
        self.hf_model = hf_model.to(resolved).eval()
        # ModelConfig.max_model_len: the engine argument, else derived from the checkpoint's config.
        max_model_len = kwargs.get("max_model_len") or hf_model.config.max_position_embeddings
        self.model_config = types.SimpleNamespace(
            dtype=resolved, max_model_len=max_model_len, max_logprobs=kwargs.get("max_logprobs", 20)
        )
        # The engine process exits on shutdown: the locks of writes it never finished are released.
        self.llm_engine = types.SimpleNamespace(
            engine_core=EngineCoreClient(lambda: self.release_stalled_writes(write=False))
        )
        self.request_counter = itertools.count()
        self.writer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="vllm-hs-save")
        self.pending: list[PendingSave] = []
        self.stalled: list[PendingSave] = []
        # Per-instance faults, by row of the next `generate` call.
        self.fail_write_rows: set[int] = set()
        self.stall_write_rows: set[int] = set()
        self.abort_rows: set[int] = set()
        LLM.created.append(self)

    def capture(self, prompts: list[list[int]]) -> list[tuple[Tensor, Tensor]]:
        """Each request's captured states [n, n_capture, H] in file order and vLLM's last-position logits.

        Capture id k is `hidden_states + residual` entering decoder layer k (llama.py `LlamaModel.forward`
        calls `_maybe_add_hidden_state` before layer 0 and after each layer); id L is taken before
        `self.norm`. In transformers, `hidden_states[k]` (k < L) is that same residual stream and the
        final norm's input is the pre-norm state. Requests of equal length share one unpadded forward.
        """
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        num_layers = self.hf_model.config.num_hidden_layers
        results: dict[int, tuple[Tensor, Tensor]] = {}
        for indices in by_length.values():
            out, pre_norm = self.forward(torch.tensor([prompts[i] for i in indices]))
            layers = [pre_norm if k == num_layers else out.hidden_states[k] for k in self.capture_layers]
            stacked = torch.stack(layers, dim=2)  # [rows, n, n_capture, H]
            logits = out.logits[:, -1].float()
            if LLM.logit_fault is not None:
                logits = LLM.logit_fault(logits)
            for row, i in enumerate(indices):
                results[i] = (stacked[row].clone(), logits[row])
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

    @staticmethod
    def write(save: PendingSave) -> None:
        """`ExampleHiddenStatesConnector._write_tensors`: save, then close the fd holding LOCK_EX. A failed
        write is only logged by vLLM (`_on_write_done`): the lock is released and no file appears."""
        try:
            if save.fail:
                raise OSError("No space left on device")
            save_file(save.tensors, save.filename)
        finally:
            os.close(save.lock_fd)

    def step(self) -> None:
        """One engine step's worker side (`get_finished`): submit the writes of requests finished before."""
        pending, self.pending = self.pending, []
        for save in pending:
            if save.stall:
                self.stalled.append(save)  # a writer that does not finish until released
            else:
                self.writer.submit(self.write, save)

    def release_stalled_writes(self, *, write: bool = True) -> None:
        """End the stalled writes: written (the file appears late), or dropped with the engine process."""
        stalled, self.stalled = self.stalled, []
        for save in stalled:
            if write:
                self.write(save)
            else:
                os.close(save.lock_fd)

    def generate(
        self,
        prompts: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if not self.llm_engine.engine_core.running:
            raise RuntimeError("the engine core has shut down")
        params = sampling_params or SamplingParams()
        num_logprobs = params.logprobs
        if num_logprobs is not None and num_logprobs > self.model_config.max_logprobs:
            # SamplingParams._validate_logprobs
            raise ValueError(
                f"Requested sample logprobs of {num_logprobs}, which is greater than max allowed: "
                f"{self.model_config.max_logprobs}"
            )
        token_lists = [list(prompt["prompt_token_ids"]) for prompt in prompts]
        for token_ids in token_lists:
            # InputProcessor._validate_prompt_len (vllm/v1/engine/input_processor.py)
            if not token_ids:
                raise ValueError("The decoder prompt cannot be empty")
            if len(token_ids) >= self.model_config.max_model_len:
                raise ValueError(
                    f"The decoder prompt (length {len(token_ids)}) plus the number of requested output "
                    "tokens (at least 1) is longer than the maximum model length"
                )
        # In-process, the engine steps only while the client waits: the previous batch's writes happen now.
        self.step()
        outputs = []
        for row, (token_ids, (states, logits)) in enumerate(
            zip(token_lists, self.capture(token_lists), strict=True)
        ):
            # LLM._add_request: external id = the counter; InputProcessor.assign_request_id appends a suffix.
            request_id = str(next(self.request_counter))
            internal_id = f"{request_id}-{secrets.token_hex(4)}"
            filename = os.path.join(self.storage_path, f"{internal_id}.safetensors")
            # wait_for_save, in the step that schedules the request: the lock exists and is held.
            os.makedirs(os.path.dirname(filename), exist_ok=True)
            lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            # request_finished: token_ids = torch.tensor(request.prompt_token_ids) (int64)
            ids_tensor = torch.tensor(token_ids)
            if LLM.capture_fault is not None:
                states, ids_tensor = LLM.capture_fault(states, ids_tensor)
            tensors = {"hidden_states": states.contiguous(), "token_ids": ids_tensor}
            self.pending.append(
                PendingSave(
                    filename,
                    lock_fd,
                    tensors,
                    fail=row in self.fail_write_rows,
                    stall=row in self.stall_write_rows,
                )
            )
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=token_ids,
                    outputs=[self.completion(logits, params, aborted=row in self.abort_rows)],
                    finished=True,
                    kv_transfer_params={"hidden_states_path": filename},
                )
            )
        if self.multiprocess:
            # The engine core keeps stepping for the delayed block frees: the writes start a step later.
            threading.Timer(STEP_S, self.step).start()
        # OfflineInferenceMixin._run_engine returns outputs sorted by int(request_id).
        return sorted(outputs, key=lambda o: int(o.request_id))

    @staticmethod
    def completion(logits: Tensor, params: SamplingParams, *, aborted: bool) -> CompletionOutput:
        """The greedy token with its raw logprobs (`logprobs_mode="raw_logprobs"`, the default): the top
        `params.logprobs` ids plus the sampled one. An aborted request has no token."""
        if aborted:
            return CompletionOutput(0, "", [], None, None, finish_reason="abort")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token = int(logits.argmax())
        sample_logprobs = None
        if params.logprobs is not None:
            ids = [token, *logprobs.topk(params.logprobs).indices.tolist()]
            ranks = (logprobs[None, :] > logprobs[ids, None]).sum(dim=1) + 1  # 1 = the most likely
            sample_logprobs = [
                {t: Logprob(float(logprobs[t]), int(r)) for t, r in zip(ids, ranks.tolist(), strict=True)}
            ]
        return CompletionOutput(
            0, "", [token], float(logprobs[token]), sample_logprobs, finish_reason="length"
        )


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
