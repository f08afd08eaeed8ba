"""The SGLang engine runner: EAGLE-3 supervision from SGLang 0.5.23's own model runner, in this process (or
one per tensor-parallel rank, each in a process of its own: `sglang_tp`).

One extend (prefill) forward per batch, every row its own causal sequence, with SGLang's own aux capture
(`--enable-return-aux-hidden-states`, EAGLE-3 convention: aux id i is the output of decoder layer i, the
project's) and `CaptureHiddenMode.FULL`. Two things SGLang does not hand back are taken on the way: the
logits processor computes logits only at each row's last position, so a wrapper of its `forward` keeps the
post-norm final hidden state of every position (the logits are lm_head of it, computed where a format
needs them); and h_L before the final norm is the updated residual the final norm returns (a forward hook).
The steps follow `sglang/benchmark/one_batch.py` of the 0.5.23 wheel (docs/sglang.md gives file:line);
`sglang` is imported lazily so the rest of the package works without it. Engine arguments and what is
refused before anything loads are in `sglang_args`.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from eagle3_target.contract import default_aux_layer_ids, validate_aux_layer_ids
from eagle3_target.runners.base import (
    InvalidInput,
    ModelRefused,
    check_inputs,
    parse_max_batch_tokens,
    process_lost,
    refuse_batches_beyond_cache,
    text_config,
)
from eagle3_target.runners.checkpoint import HeadWeights, load_head_weights
from eagle3_target.runners.sglang_args import (
    refuse_unsupported_model,
    server_args_for,
)
from eagle3_target.runners.sglang_tp import KVPool, RankProcesses

# SGLang builds its process groups and runtime context once a process (`bootstrap.init_parallel_runtime`
# refuses a second build), so one runner at a time: the open one, if any.
_open_runner: list[SGLangRunner] = []

# SGLang reads this at import: without it, it takes its CUDA paths (and imports vLLM's rotary op).
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


def open_runners() -> list[SGLangRunner]:
    """The SGLang runners open in this process (at most one)."""
    return list(_open_runner)


class TargetHead(nn.Module):
    """The runner's `model`: the config plus the output-side weights, read from the checkpoint (SGLang's
    own copies may be sharded across tensor-parallel ranks)."""

    def __init__(self, config: PretrainedConfig, weights: HeadWeights) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(weights.input_embeddings, requires_grad=False)
        self.norm = nn.Parameter(weights.final_norm, requires_grad=False)
        self.lm_head = nn.Parameter(weights.lm_head, requires_grad=False)


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
    """One tensor-parallel rank's SGLang `ModelRunner` with the capture on it: the extend forwards, the aux
    layer list, and what SGLang does not return (the wrapper and the hook). Rank 0's results are the
    runner's: the states it captures are whole (SGLang all-reduces each layer's output across the ranks)."""

    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self.failure: str | None = None
        self._layers: list[int] = []
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
        """Capture `layers` (ascending) from the next forward on: SGLang reads its list at every forward
        (the runner captures no CUDA graphs)."""
        self.model_runner.model.set_eagle3_layers_to_capture(layers)
        self._layers = list(layers)

    def extend(self, prompts: list[list[int]], prenorm: bool) -> tuple[Tensor, Tensor]:
        """One extend forward of `prompts`: ([tokens, H] final (or h_L), [tokens, 3H] aux, ascending)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        self._final.clear()
        self._prenorm.clear()
        try:
            output = self._prefill(prompts, CaptureHiddenMode.FULL)
            if len(self._final) != 1 or len(self._prenorm) != 1 or output.hidden_states is None:
                raise RuntimeError(
                    f"SGLang's forward gave {len(self._final)} final and {len(self._prenorm)} pre-norm "
                    "states (one each expected) or no aux states"
                )
            return (self._prenorm[0] if prenorm else self._final[0]), output.hidden_states
        finally:
            self._final.clear()
            self._prenorm.clear()

    def plain_prefill(self, prompts: list[list[int]]) -> None:
        """SGLang's own prefill as its server runs one: no aux capture, last-position logits only."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        model = self.model_runner.model
        model.capture_aux_hidden_states = False
        model.model.layers_to_capture = []
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


class SGLangRunner:
    """`TargetRunner` over SGLang's `ModelRunner`: in this process for one rank, in one worker process per
    rank for tensor parallelism (`sglang_tp`)."""

    def __init__(
        self,
        ranks: Ranks,
        config: PretrainedConfig,
        head: TargetHead,
        aux_layer_ids: Sequence[int],
        server_args: Any,
    ) -> None:
        self._ranks = ranks
        self._server_args = server_args
        self._config = config
        self._head = head
        self._device = head.embed_tokens.device
        self._aux_layer_ids: list[int] = []
        self.set_aux_layers(aux_layer_ids)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | str | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
        max_batch_tokens: int | str | None = None,
        **engine_kwargs: object,
    ) -> SGLangRunner:
        """Load the model into SGLang's model runner (one per tensor-parallel rank). `max_batch_tokens` (the
        server's) sizes the KV cache on CPU and must fit in the one SGLang allocates; `engine_kwargs` are
        SGLang server arguments (`sglang_args.server_args_for`). Everything that can be refused is refused
        before SGLang loads, and a rank that fails to load fails the whole runner with its reason."""
        batch_tokens = parse_max_batch_tokens(max_batch_tokens)
        path = os.fspath(model_path)
        full_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = text_config(full_config)
        ids = default_aux_layer_ids(config.num_hidden_layers) if aux_layer_ids is None else aux_layer_ids
        ids = validate_aux_layer_ids(ids, config.num_hidden_layers)
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if resolved.type == "cpu":
            os.environ[CPU_ENGINE_ENV] = "1"
        refuse_unsupported_model(path, full_config)
        server_args = server_args_for(
            path,
            dtype=dtype,
            device=resolved.type,
            aux_layer_ids=ids,
            trust_remote_code=trust_remote_code,
            max_batch_tokens=batch_tokens,
            engine_kwargs=engine_kwargs,
        )
        if _open_runner:
            raise ModelRefused(
                "an SGLang runner is already open in this process (SGLang builds its process groups once a "
                "process); close it first"
            )
        ranks: Ranks
        if server_args.tp_size > 1:
            ranks = RankProcesses.start(server_args)
        else:
            ranks = RankCapture(start_model_runner(server_args))
        try:
            refuse_batches_beyond_cache(
                batch_tokens,
                ranks.pool.tokens,
                "raise the engine argument mem_fraction_static (max_total_tokens on CPU)",
            )
            weights = load_head_weights(
                path,
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                dtype=ranks.dtype,
                device=resolved,
            )
            runner = cls(ranks, config, TargetHead(config, weights), ids, server_args)
        except BaseException:
            ranks.close()
            raise
        _open_runner.append(runner)
        return runner

    # -- TargetRunner surface --

    @property
    def model(self) -> TargetHead:
        return self._head

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self._aux_layer_ids)

    @property
    def engine(self) -> Any:
        """SGLang's `ModelRunner`, for inspection (its `server_args` say what SGLang runs with); None when
        the ranks run in worker processes."""
        return getattr(self._ranks, "model_runner", None)

    @property
    def server_args(self) -> Any:
        """SGLang's `ServerArgs` every rank runs with (`nccl_port`: the ranks' rendezvous)."""
        return self._server_args

    def placements(self) -> list[tuple[int, int, int, list[int]]]:
        """Each rank's (tp_rank, tp_size, attention heads, SGLang's capture list), rank 0 first."""
        return self._ranks.placements()

    @property
    def max_prompt_len(self) -> int:
        """Longest row SGLang's model runner takes (its context length)."""
        return self._ranks.context_len

    @property
    def failure(self) -> str | None:
        return self._ranks.failure

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Select the aux layers on every rank, with no restart. SGLang captures in layer order;
        `forward_hidden` reorders."""
        ids = validate_aux_layer_ids(aux_layer_ids, self._config.num_hidden_layers)
        self._ranks.set_layers(sorted(ids))
        self._aux_layer_ids = ids

    def input_embedding_weight(self) -> Tensor:
        return self.model.embed_tokens.detach()

    def lm_head_weight(self) -> Tensor:
        return self.model.lm_head.detach()

    def final_norm_weight(self) -> Tensor:
        return self.model.norm.detach()

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(final_norm(h_L) [B,S,H], aux [B,S,3H]) unshifted; padding positions are zeros. With `prenorm`,
        h_L before the final norm."""
        ids, mask = check_inputs(input_ids, attention_mask, self._config.vocab_size)
        lengths = mask.sum(dim=1).tolist()
        if max(lengths) > self.max_prompt_len:
            raise InvalidInput(
                f"a row has {max(lengths)} tokens; the SGLang engine takes at most {self.max_prompt_len} "
                "(its context length)"
            )
        refusal = self._ranks.pool.refusal(lengths)
        if refusal is not None:
            raise InvalidInput(f"{refusal}: send fewer tokens at once")
        prompts = [ids[r, : lengths[r]].tolist() for r in range(ids.shape[0])]
        final, aux = self._ranks.extend(prompts, prenorm)
        batch, seq = ids.shape
        hidden = self._config.hidden_size
        dtype = self.model.norm.dtype
        out_final = torch.zeros(batch, seq, hidden, dtype=dtype, device=self._device)
        out_aux = torch.zeros(batch, seq, len(self._aux_layer_ids) * hidden, dtype=dtype, device=self._device)
        # SGLang packs its captures in ascending layer order; put them back in the requested one.
        order = [sorted(self._aux_layer_ids).index(i) for i in self._aux_layer_ids]
        aux = aux.view(aux.shape[0], len(order), hidden)[:, order].flatten(start_dim=1)
        start = 0
        for r, n in enumerate(lengths):
            out_final[r, :n] = final[start : start + n].to(device=self._device, dtype=dtype)
            out_aux[r, :n] = aux[start : start + n].to(device=self._device, dtype=dtype)
            start += n
        return out_final, out_aux

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B,S,V] = lm_head(final_norm(h_L)), aux [B,S,3H]) unshifted."""
        final, aux = self.forward_hidden(input_ids, attention_mask)
        return torch.nn.functional.linear(final, self.model.lm_head), aux

    def plain_prefill(self, input_ids: Tensor) -> None:
        """SGLang's own prefill of the rows (all real tokens) as its server runs one: no aux capture,
        logits at each row's last position only. The baseline the acceptance suite times the capture
        against (scripts/smoke_sglang.py)."""
        self._ranks.plain_prefill([row.tolist() for row in input_ids])

    def close(self) -> None:
        """Release the model runners and SGLang's process groups (and the rank processes)."""
        if self not in _open_runner:
            return
        _open_runner.remove(self)
        self._ranks.close()


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
