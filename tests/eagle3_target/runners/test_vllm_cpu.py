"""The vLLM runner's CPU-platform parts (runners/vllm_cpu.py): the plugin that adapts vLLM's hidden-states
connector, inspected on a fresh copy of vLLM's own connector module, and the KV cache size for CPU.

The plugin must change nothing where vLLM runs on CUDA (the image's vLLM loads it too): there it neither
imports nor touches the connector. On the CPU platform it patches exactly two things, once."""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import entry_points
from types import ModuleType

import pytest
import torch
from eagle3_target.runners import vllm_cpu
from transformers import AutoConfig


@pytest.fixture
def fresh_connector(monkeypatch) -> ModuleType:
    """A new copy of vLLM's connector module (the real one may have been adapted by an engine already),
    standing in for it under its name."""
    found = importlib.util.find_spec(vllm_cpu.CONNECTOR_MODULE)
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, vllm_cpu.CONNECTOR_MODULE, module)
    return module


def test_the_plugin_is_a_vllm_general_plugin():
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("eagle3_target")]
    assert plugin.load() is vllm_cpu.register


def test_off_the_cpu_platform_the_plugin_changes_nothing(fresh_connector, monkeypatch):
    connector = fresh_connector.ExampleHiddenStatesConnector
    submit = connector.__dict__["_submit_async_write"]
    monkeypatch.setattr(vllm_cpu, "cpu_platform", lambda: False)
    vllm_cpu.register()
    assert fresh_connector.torch is torch
    assert connector.__dict__["_submit_async_write"] is submit
    assert not hasattr(connector, vllm_cpu.ADAPTED_MARK)


def test_on_the_cpu_platform_it_unpins_the_copy_and_makes_its_event_pollable(fresh_connector, monkeypatch):
    connector = fresh_connector.ExampleHiddenStatesConnector
    submit = connector.__dict__["_submit_async_write"]
    monkeypatch.setattr(vllm_cpu, "cpu_platform", lambda: True)
    vllm_cpu.register()
    vllm_cpu.register()  # vLLM loads plugins in every process, sometimes twice: adapted once
    wrapped = connector.__dict__["_submit_async_write"]
    assert wrapped is not submit and wrapped.__wrapped__ is submit
    # What the connector allocates its host copy with: pin_memory is dropped, the rest is torch.
    source = torch.arange(6.0).reshape(2, 3)
    copy = fresh_connector.torch.empty_like(source, device="cpu", pin_memory=True)
    assert copy.shape == source.shape and not copy.is_pinned()
    assert fresh_connector.torch.float32 is torch.float32 and fresh_connector.torch.cuda is torch.cuda

    class EventWithoutQuery:  # vLLM's CPU placeholder for torch.cuda.Event has record/wait/synchronize only
        pass

    class Pending:
        req_id = "r1"

    class Connector:
        def __init__(self) -> None:
            self._req_copy_events: dict[str, object] = {}

    def original(self, pending) -> None:
        self._req_copy_events[pending.req_id] = EventWithoutQuery()

    instance = Connector()
    vllm_cpu._with_pollable_events(original)(instance, Pending())
    assert instance._req_copy_events["r1"].query() is True


def test_the_cpu_kv_cache_holds_a_whole_batch_or_one_longest_row(tiny_llama_dir):
    config = AutoConfig.from_pretrained(tiny_llama_dir)  # 8 layers, 1 KV head of 32, hidden 64
    per_token = 2 * 8 * 1 * 32 + 4 * 64  # keys and values, plus the 4 captured layers
    assert config.head_dim == 32 and config.num_key_value_heads == 1

    block = vllm_cpu.KV_CACHE_BLOCK_TOKENS

    def allocated(tokens: int, itemsize: int) -> int:  # whole blocks, one spare per cache group, headroom
        blocks = -(-tokens // block) + vllm_cpu.KV_CACHE_GROUPS
        return int(per_token * itemsize * blocks * block * vllm_cpu.KV_CACHE_HEADROOM)

    assert kv_bytes(config, "float32", 512, 4096) == allocated(4096, 4)
    # A batch smaller than one row of max_model_len; no limits at all: the config's longest row, as fp32.
    assert kv_bytes(config, "bfloat16", 512, 100) == allocated(512, 2)
    assert kv_bytes(config, "auto", None, None) == allocated(config.max_position_embeddings, 4)
    # A short row still gets a whole block per group (vLLM refuses a cache without one).
    assert kv_bytes(config, "float32", 65, None) >= per_token * 4 * block * (1 + vllm_cpu.KV_CACHE_GROUPS)


def test_the_kv_cache_size_someone_set_wins(tiny_llama_dir, monkeypatch):
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    monkeypatch.setattr(vllm_cpu, "cpu_platform", lambda: True)
    monkeypatch.delenv(vllm_cpu.CPU_KV_CACHE_ENV, raising=False)
    sized = vllm_cpu.with_cpu_defaults({"max_model_len": 300}, config, "float32", 1000)
    assert sized == {"max_model_len": 300, "kv_cache_memory_bytes": kv_bytes(config, "float32", 300, 1000)}
    assert vllm_cpu.with_cpu_defaults({"kv_cache_memory_bytes": 7}, config, "float32", 1000) == {
        "kv_cache_memory_bytes": 7
    }
    monkeypatch.setenv(vllm_cpu.CPU_KV_CACHE_ENV, "2")
    assert vllm_cpu.with_cpu_defaults({}, config, "float32", 1000) == {}
    monkeypatch.setattr(vllm_cpu, "cpu_platform", lambda: False)
    monkeypatch.delenv(vllm_cpu.CPU_KV_CACHE_ENV)
    assert vllm_cpu.with_cpu_defaults({}, config, "float32", 1000) == {}  # a GPU sizes it by its share


def kv_bytes(config, dtype: str, max_model_len: int | None, max_batch_tokens: int | None) -> int:
    return vllm_cpu.cpu_kv_cache_bytes(
        config, dtype, max_model_len=max_model_len, max_batch_tokens=max_batch_tokens
    )
