"""What the vLLM runner refuses before vLLM starts (runners/vllm_refusals.py, and the engine arguments the
capture cannot run with): each refusal names the reason, starts no engine and leaves CUDA uninitialised."""

from __future__ import annotations

import json
import shutil

import pytest
from eagle3_target.runners import ModelRefused

from support.vllm_runner import copy_model, open_runner


def test_model_without_eagle3_interface_is_refused_before_engine_start(
    tiny_llama_dir, fake_vllm, shm, tmp_path
):
    model_dir = tmp_path / "gemma3-like"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not implement the EAGLE-3 interface"):
        open_runner(model_dir, shm)
    assert fake_vllm.LLM.created == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim_model_base": 16}, r"config\.dim_model_base"),  # MiniCPM: lm_head(final_norm(h) / 4)
        ({"output_multiplier": 0.5}, r"config\.output_multiplier"),  # MuseGlimmer
        ({"kv_lora_rank": 16}, r"MLA attention"),
        ({"model_type": "qwen3_next"}, r"\(1 \+ w\) RMSNorm"),
    ],
)
def test_models_the_rebuild_cannot_reproduce_are_refused_before_engine_start(
    tiny_llama_dir, fake_vllm, shm, tmp_path, changes, message
):
    model_dir = copy_model(tiny_llama_dir, tmp_path / "model", **changes)
    with pytest.raises(ModelRefused, match=message) as refused:
        open_runner(model_dir, shm)
    assert "--engine hf" in str(refused.value)
    assert fake_vllm.LLM.created == []
    assert list(shm.iterdir()) == []


def test_pipeline_parallelism_is_refused_before_engine_start(tiny_llama_dir, fake_vllm, shm):
    with pytest.raises(ModelRefused, match=r"pipeline_parallel_size=2 .*last pipeline stage"):
        open_runner(tiny_llama_dir, shm, pipeline_parallel_size=2)
    assert fake_vllm.LLM.created == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("env", "engine_args"),
    [
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, {}),
        ({}, {"distributed_executor_backend": "external_launcher"}),
    ],
)
def test_in_process_engine_is_refused(tiny_llama_dir, fake_vllm, shm, monkeypatch, env, engine_args):
    """In-process, the last batch's files are written only at the next engine step, which never comes:
    reading them would block forever."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelRefused, match=r"VLLM_ENABLE_V1_MULTIPROCESSING"):
        open_runner(tiny_llama_dir, shm, **engine_args)
    assert fake_vllm.LLM.created == []


def test_the_eagle3_check_leaves_cuda_uninitialised_in_this_process(tiny_llama_dir, fake_vllm, shm, tmp_path):
    """Importing vLLM's model class may initialise CUDA, which makes vLLM spawn its workers; the runner
    inspects the class in a child process, as vLLM's registry does, and still refuses unsupported ones."""
    runner = open_runner(tiny_llama_dir, shm)
    assert not fake_vllm.CUDA_STATE.initialized
    runner.close()
    gemma = copy_model(tiny_llama_dir, tmp_path / "gemma3-like", architectures=["Gemma3ForCausalLM"])
    with pytest.raises(ModelRefused, match=r"does not implement the EAGLE-3 interface"):
        open_runner(gemma, shm)
    assert not fake_vllm.CUDA_STATE.initialized
