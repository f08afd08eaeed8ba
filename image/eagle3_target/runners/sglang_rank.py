"""One SGLang 0.5.23 tensor-parallel rank: its `ModelRunner` (`start_model_runner`) and the capture on it
(`RankCapture`), which `sglang.SGLangRunner` runs in its own process for one rank and `sglang_tp` in one
worker process per rank; `Ranks` is what the runner asks of either. Every SGLang internal the runner
relies on is called here; docs/sglang.md gives the file:line of each.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from eagle3_target.runners.base import ModelRefused, process_lost

# SGLang reads this at import: without it, it takes its CUDA paths (and imports vLLM's rotary op).
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


def use_cpu_engine(device: torch.device) -> None:
    """Put SGLang on its CPU paths in this process when `device` is the CPU. It must come before SGLang's
    first import here: SGLang caches what it read (`srt/utils/common.py` `is_cpu`, an lru_cache) and its
    modules copy it at import, so checking the engine arguments before loading would otherwise fix the CUDA
    paths."""
    if device.type == "cpu":
        os.environ[CPU_ENGINE_ENV] = "1"


class KVPool(NamedTuple):
    """What SGLang allocated at start for the one batch a rank holds at a time: KV cache slots (tokens),
    request slots (rows), and the page size each row's slots are rounded up to."""

    tokens: int
    rows: int
    page: int

    def refusal(self, lengths: list[int]) -> str | None:
        """Why a batch of rows of `lengths` does not fit (SGLang's allocation would fail it, and not with
        its own message: the runner has no prefix cache to evict from), or None when it does."""
        slots = sum(-(-n // self.page) * self.page for n in lengths)
        if len(lengths) > self.rows:
            return f"the batch has {len(lengths)} rows; the engine's request pool holds {self.rows}"
        if slots > self.tokens:
            return f"the batch needs {slots} KV cache slots; the engine's KV cache holds {self.tokens}"
        return None


class _TreeCache(SimpleNamespace):
    """The radix cache a scheduler would own, reduced to what `ScheduleBatch` asks of it: no prefix
    sharing (every position is computed), nothing to evict."""

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def evict(self, params: Any) -> None:
        pass

    def maybe_hand_to_session(self, req: Any) -> None:
        pass


class RankCapture:
    """One tensor-parallel rank's SGLang `ModelRunner` with the capture on it: the extend forwards, the
    capture list, and what SGLang does not return (the wrapper and the hook). Rank 0's results are the
    runner's: the states it captures are whole (SGLang all-reduces each layer's output across the ranks)."""

    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self.failure: str | None = None
        self._layers: list[int] = []
        self._last = int(model_runner.model_config.num_hidden_layers) - 1
        # Set only during a forward: where the wrapper and the hook put what SGLang does not return.
        self._final: list[Tensor] = []
        self._prenorm: list[Tensor] = []
        model = model_runner.model
        model.logits_processor.forward = self._keeping_final(model.logits_processor.forward)
        model.model.norm.register_forward_hook(self._keep_prenorm)

    def _keeping_final(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def keeping_final(input_ids: Tensor, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
            self._final.append(hidden_states)
            return forward(input_ids, hidden_states, *args, **kwargs)

        return keeping_final

    def _keep_prenorm(self, _module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        # Called with (x, residual), SGLang's RMSNorm returns (normed, x + residual): that sum is h_L.
        self._prenorm.append(output[1] if isinstance(output, tuple) else inputs[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.model_runner.model_config.dtype

    @property
    def context_len(self) -> int:
        return int(self.model_runner.model_config.context_len)

    @property
    def pool(self) -> KVPool:
        """The KV cache and request slots SGLang allocated at start (all free between batches)."""
        runner = self.model_runner
        return KVPool(
            tokens=int(runner.token_to_kv_pool_allocator.available_size()),
            rows=int(runner.req_to_token_pool.available_size()),
            page=int(runner.page_size or 1),
        )

    def placement(self) -> tuple[int, int, int, list[int]]:
        """(tp_rank, tp_size, this rank's attention heads, its capture list as SGLang's layer indices):
        what SGLang made of this rank, for inspection."""
        from sglang.srt.runtime_context import get_parallel

        model = self.model_runner.model
        parallel = get_parallel()
        heads = int(model.model.layers[0].self_attn.num_heads)
        return parallel.tp_rank, parallel.tp_size, heads, list(model.model.layers_to_capture)

    def placements(self) -> list[tuple[int, int, int, list[int]]]:
        return [self.placement()]

    def set_layers(self, layers: list[int]) -> None:
        """Capture `layers` (HF ids, ascending) from the next forward on: SGLang reads its list at every
        forward (the runner captures no CUDA graphs). SGLang takes a layer's output as the next layer's
        input, so it never captures the last layer L-1; that one is h_L, which the hook keeps."""
        self._capture_in_sglang([i for i in layers if i != self._last])
        self._layers = list(layers)

    def _capture_in_sglang(self, layers: list[int]) -> None:
        model = self.model_runner.model
        if layers:
            model.set_eagle3_layers_to_capture(layers)
        else:  # SGLang's model would expect aux states it does not capture
            model.capture_aux_hidden_states = False
            model.model.layers_to_capture = []

    def extend(self, prompts: list[list[int]], prenorm: bool) -> tuple[Tensor, Tensor]:
        """One extend forward of `prompts`: ([tokens, H] final (or h_L), [tokens, n*H] the captured layers,
        ascending)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        self._final.clear()
        self._prenorm.clear()
        try:
            output = self._prefill(prompts, CaptureHiddenMode.FULL)
            if len(self._final) != 1 or len(self._prenorm) != 1:
                raise RuntimeError(
                    f"SGLang's forward gave {len(self._final)} final and {len(self._prenorm)} pre-norm "
                    "states (one each expected)"
                )
            final, last = self._final[0], self._prenorm[0]
            parts = [output.hidden_states] if self._layers != [self._last] else []
            if self._last in self._layers:
                parts.append(last)  # the last layer comes last in ascending order
            if any(part is None for part in parts):
                raise RuntimeError("SGLang's forward gave no aux states")
            captured = torch.cat(parts, dim=-1)
            if captured.shape != (final.shape[0], len(self._layers) * final.shape[-1]):
                raise RuntimeError(
                    f"SGLang captured states of shape {tuple(captured.shape)} for the layers {self._layers} "
                    f"of {final.shape[0]} tokens"
                )
            return (last if prenorm else final), captured
        finally:
            self._final.clear()
            self._prenorm.clear()

    def plain_prefill(self, prompts: list[list[int]]) -> None:
        """SGLang's own prefill as its server runs one: no aux capture, last-position logits only."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        self._capture_in_sglang([])
        try:
            self._prefill(prompts, CaptureHiddenMode.NULL)
        finally:
            self._final.clear()
            self._prenorm.clear()
            self.set_layers(self._layers)

    def _prefill(self, prompts: list[list[int]], capture_hidden_mode: Any) -> Any:
        """One extend forward of `prompts` from an empty KV cache: SGLang's logits-processor output."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.model_runner
        reqs = []
        for i, prompt in enumerate(prompts):
            req = Req(
                rid=str(i),
                origin_input_text="",
                origin_input_ids=array("q", prompt),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(req.origin_input_ids)
            reqs.append(req)
        tree_cache = _TreeCache(
            page_size=get_schedule().page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        try:
            with torch.no_grad():
                batch = ScheduleBatch.init_new(
                    reqs=reqs,
                    req_to_token_pool=runner.req_to_token_pool,
                    token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                    tree_cache=tree_cache,
                    model_config=runner.model_config,
                    enable_overlap=False,
                    spec_algorithm=SpeculativeAlgorithm.NONE,
                )
                batch.prepare_for_extend()
                if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                    # As one_batch.py does: the scheduler moves the ids to the device later.
                    batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
                    batch.prefill_input_ids_cpu = None
                forward_batch = ForwardBatch.init_new(
                    batch,
                    runner,
                    capture_hidden_mode=capture_hidden_mode,
                    return_hidden_states_before_norm=False,
                )
                return runner.forward(forward_batch).logits_output
        except Exception as exc:
            if process_lost(exc):
                self.failure = f"SGLang's model runner lost its device: {type(exc).__name__}: {exc}"
            raise
        finally:
            # Every batch starts from an empty KV cache: nothing is shared between requests.
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()

    def close(self) -> None:
        """Release the model runner and SGLang's process groups."""
        from sglang.srt.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        self.model_runner = None
        destroy_model_parallel()
        destroy_distributed_environment()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class Ranks(Protocol):
    """What the runner asks of its tensor-parallel ranks: one `RankCapture` in this process, or
    `sglang_tp.RankProcesses` driving one per worker process."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def context_len(self) -> int: ...

    @property
    def pool(self) -> KVPool: ...

    @property
    def failure(self) -> str | None: ...

    def placements(self) -> list[tuple[int, int, int, list[int]]]: ...

    def set_layers(self, layers: list[int]) -> None: ...

    def extend(self, prompts: list[list[int]], prenorm: bool) -> tuple[Tensor, Tensor]: ...

    def plain_prefill(self, prompts: list[list[int]]) -> None: ...

    def close(self) -> None: ...


def start_model_runner(server_args: Any, tp_rank: int = 0) -> Any:
    """SGLang's model runner for `server_args`, as `sglang/benchmark/one_batch.py` (0.5.23) builds one for
    tensor-parallel rank `tp_rank` (on device `tp_rank`; every rank's process calls this with the same
    arguments, `server_args.nccl_port` naming their rendezvous): resolve the arguments, publish the
    process's runtime context, build the parallel groups, load the weights, allocate the KV cache and
    attention backends."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    server_args.resolve_once()
    _set_envs_and_config(server_args)
    # The port of the process groups' rendezvous, as `PortArgs.init_new` picks it (`srt/server_args.py:773`);
    # PortArgs itself also creates five IPC files (`server_args.py:807-812`) that nothing here would remove.
    nccl_port = server_args.nccl_port or get_free_port_below_ephemeral()
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(
            world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank
        ),
    )
    initialize_moe_config()
    initialize_fp8_gemm_config()
    initialize_bf16_gemm_config()
    initialize_fp4_gemm_config()
    model_config = ModelConfig.from_server_args(server_args)
    bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=nccl_port)
    bootstrap.init_layer_runtime(model_config=model_config)
    runner = ModelRunner(
        model_config=model_config,
        mem_fraction_static=server_args.mem_fraction_static,
        gpu_id=tp_rank,
        nccl_port=nccl_port,
        server_args=server_args,
    )
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    if runner.model_config.hf_config is None:
        raise ModelRefused("SGLang loaded no model config")
    return runner
