"""The stand-in's offline engine, `vllm.LLM` of vLLM 0.33: start (checked as in `engine_start`), the engine
core's stepping, and `generate` with a real transformers forward of the (tiny) checkpoint.

`generate` captures, per request, the residual stream entering each capture layer (id L = the final
pre-norm state), in the file order of the backend (`engine_start.start_workers`), and returns the greedy
token with vLLM's raw log-probabilities. Each request's file is written a step after the request finished
(`connector`): in multiprocess mode the engine core keeps stepping after `generate` returns; in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) the next step is the next `generate` call, so reading a batch's files
right after its `generate` blocks forever. Tests can make a write fail (lock released, no file), stall
(lock never released), or abort a request (no token, file still written), and transform vLLM's logits
(`logit_fault`) or captures (`capture_fault`).
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from support.fake_vllm.connector import PendingSave, hold_lock, write_tensors
from support.fake_vllm.engine_start import check_configs, resolve_auto_dtype, start_workers
from support.fake_vllm.outputs import CompletionOutput, Logprob, RequestOutput, SamplingParams

# Seconds one engine step takes in the stand-in: the delay between a request finishing and its write.
STEP_S = 0.02
# vLLM's default KV cache block size on CUDA (`CacheConfig.block_size`).
KV_BLOCK_TOKENS = 16


class EngineCoreClient:
    """`SyncMPClient`: `resources.engine_dead` is set once the engine core process is gone (shut down, or
    exited on its own: a test sets it to play a dead engine core)."""

    def __init__(self, on_shutdown: Callable[[], None]) -> None:
        self.running = True
        self.on_shutdown = on_shutdown
        self.resources = types.SimpleNamespace(engine_dead=False)

    def shutdown(self, timeout: float | None = None) -> None:
        self.running = False
        self.resources.engine_dead = True
        self.on_shutdown()


class LLM:
    """Offline engine. Each `generate` call is one scheduler batch of pure prefills (max_tokens=1)."""

    created: ClassVar[list[LLM]] = []
    # Test hooks, set before the engine starts (its startup check runs at once): rewrite (hidden_states,
    # token_ids) before they are written, or vLLM's logits before sampling, to reproduce engine faults.
    capture_fault: ClassVar[Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None] = None
    logit_fault: ClassVar[Callable[[Tensor], Tensor] | None] = None
    # The KV cache the engine core allocates (on a GPU: what gpu_memory_utilization leaves), in tokens.
    kv_cache_tokens: ClassVar[int] = 1 << 20

    def __init__(self, model: str, **kwargs: Any) -> None:
        capture = check_configs(kwargs)
        self.init_kwargs = {"model": model, **kwargs}
        self.storage_path = capture.storage_path
        hf_model = AutoModelForCausalLM.from_pretrained(
            model, trust_remote_code=kwargs.get("trust_remote_code")
        )
        self.backend, self.capture_layers = start_workers(kwargs, hf_model.config, capture.layer_ids)
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
        # The cache config as the engine core hands it back at start (`num_gpu_blocks` filled in).
        cache_config = types.SimpleNamespace(
            block_size=KV_BLOCK_TOKENS, num_gpu_blocks=LLM.kv_cache_tokens // KV_BLOCK_TOKENS
        )
        self.llm_engine = types.SimpleNamespace(
            engine_core=EngineCoreClient(lambda: self.release_stalled_writes(write=False)),
            vllm_config=types.SimpleNamespace(cache_config=cache_config),
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

        Capture id k is `hidden_states + residual` entering decoder layer k (vLLM's `LlamaModel.forward`
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

    def step(self) -> None:
        """One engine step's worker side (`get_finished`): submit the writes of requests finished before."""
        pending, self.pending = self.pending, []
        for save in pending:
            if save.stall:
                self.stalled.append(save)  # a writer that does not finish until released
            else:
                self.writer.submit(write_tensors, save)

    def release_stalled_writes(self, *, write: bool = True) -> None:
        """End the stalled writes: written (the file appears late), or dropped with the engine process."""
        stalled, self.stalled = self.stalled, []
        for save in stalled:
            if write:
                write_tensors(save)
            else:
                os.close(save.lock_fd)

    def generate(
        self,
        prompts: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if self.llm_engine.engine_core.resources.engine_dead:
            # EngineDeadError's message
            raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
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
            # InputProcessor._validate_prompt_len
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
            lock_fd = hold_lock(filename)
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
