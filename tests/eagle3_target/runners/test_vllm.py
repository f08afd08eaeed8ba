"""The vLLM runner (runners/vllm.py) against a stand-in `vllm` (support/fake_vllm) fed by real forwards:
its supervision, weights and engine configuration, and its startup check of the logits rebuild.

The reference is the HF runner on the same checkpoint. Tolerance: the models are fp32 and the rebuild
applies the same RMSNorm and LM head formulas as transformers, so the only difference is matmul rounding:
the stand-in runs each row unpadded (as vLLM does) while the HF runner runs the padded batch, and the two
shapes accumulate in a different order. That measured at most 4e-6 here; we allow 1e-5.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from eagle3_target.runners import ModelRefused, TargetRunner, check_engine_args, load_runner, model_info
from eagle3_target.runners.hf import HFRunner
from eagle3_target.runners.vllm import VLLMRunner
from eagle3_target.runners.vllm_args import RUNNER_OPTIONS
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.target import load_target

from support.vllm_runner import copy_model, open_runner, ragged_batch

ATOL = 1e-5
HIDDEN = 64


@pytest.mark.parametrize("registered", [True, False])
@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_matches_hf_runner_on_ragged_batch(model_dir, registered, request, fake_vllm, shm, tmp_path):
    """On both of vLLM's backends: native classes write the layers ascending, the Transformers backend
    (architectures vLLM does not register) in the order it was given, so aux ids that are not ascending
    must still come back in order."""
    path = request.getfixturevalue(model_dir)
    aux = [5, 0, 3]
    hf = HFRunner.from_pretrained(path, dtype="float32", device="cpu", capture_layer_ids=aux)
    served = path if registered else copy_model(path, tmp_path / "m", architectures=["TinyForCausalLM"])
    runner = open_runner(served, shm, capture_layer_ids=aux)
    assert fake_vllm.LLM.created[-1].backend == ("vllm" if registered else "transformers")
    input_ids, mask = ragged_batch(hf.model.config.vocab_size)

    logits, aux_states = runner.forward_eagle3(input_ids, mask)
    final, aux_from_hidden = runner.forward_hidden(input_ids, mask)
    prenorm, aux_with_prenorm = runner.forward_hidden(input_ids, mask, prenorm=True)
    hf_logits, hf_aux = hf.forward_eagle3(input_ids, mask)
    hf_final, _ = hf.forward_hidden(input_ids, mask)
    hf_prenorm, _ = hf.forward_hidden(input_ids, mask, prenorm=True)

    assert logits.shape == hf_logits.shape and aux_states.shape == (3, 11, 3 * HIDDEN)
    valid = mask.bool()
    torch.testing.assert_close(logits[valid], hf_logits[valid], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(aux_states[valid], hf_aux[valid], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(final[valid], hf_final[valid], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(prenorm[valid], hf_prenorm[valid], atol=ATOL, rtol=ATOL)
    assert not torch.allclose(prenorm[valid], final[valid], atol=1e-2)  # random norm weights tell them apart
    assert torch.equal(aux_from_hidden, aux_states) and torch.equal(aux_with_prenorm, aux_states)
    # Padding positions come back as zeros, not as whatever the engine would compute there.
    assert not logits[~valid].any() and not aux_states[~valid].any() and not final[~valid].any()
    assert not prenorm[~valid].any()
    assert list(shm.iterdir()) == [runner.hidden_states_dir]
    assert not any(runner.hidden_states_dir.iterdir()), "capture files must be deleted after reading"
    runner.close()


def test_weights_and_model_info_match_hf(tiny_qwen3_dir, fake_vllm, shm):
    hf = HFRunner.from_pretrained(tiny_qwen3_dir, dtype="float32", device="cpu")
    runner = open_runner(tiny_qwen3_dir, shm / "created" / "on-demand")
    assert isinstance(runner, TargetRunner)
    assert runner.capture_layer_ids == hf.capture_layer_ids == [1, 3, 4]
    assert torch.equal(runner.input_embedding_weight(), hf.input_embedding_weight())
    assert torch.equal(runner.lm_head_weight(), hf.lm_head_weight())  # tied: the input embeddings
    assert torch.equal(runner.final_norm_weight(), hf.final_norm_weight())
    assert model_info(runner) == model_info(hf)
    runner.close()


def test_one_generate_call_per_batch_and_waits_for_async_writes(tiny_llama_dir, fake_vllm, shm, monkeypatch):
    runner = open_runner(tiny_llama_dir, shm)
    llm = fake_vllm.LLM.created[-1]
    calls = []
    real_generate = llm.generate

    def generate(prompts, *args, **kwargs):
        outputs = real_generate(prompts, *args, **kwargs)
        # The connector writes a step after the request finished: no file exists when generate returns.
        written = [Path(o.kv_transfer_params["hidden_states_path"]).exists() for o in outputs]
        calls.append(([len(p["prompt_token_ids"]) for p in prompts], written))
        return outputs

    monkeypatch.setattr(llm, "generate", generate)
    input_ids, mask = ragged_batch(256)
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert calls == [([11, 7, 3], [False, False, False])]
    assert aux_states[0, :11].abs().sum() > 0
    runner.close()


def test_engine_receives_capture_config_and_typed_engine_args(tiny_llama_dir, fake_vllm, shm):
    runner = VLLMRunner.from_pretrained(
        tiny_llama_dir,
        dtype=torch.float32,
        device="cpu",
        capture_layer_ids=[6, 1, 3],
        hidden_states_dir=shm,
        **{"gpu-memory-utilization": "0.6", "max_model_len": "512", "enforce_eager": "true"},
    )
    (llm,) = fake_vllm.LLM.created
    assert llm.init_kwargs == {
        "model": str(tiny_llama_dir),
        "dtype": "float32",
        "trust_remote_code": False,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            # Sorted, so the file order is ascending on every backend.
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 7, 8]}},
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(runner.hidden_states_dir)},
        },
        "gpu_memory_utilization": 0.6,
        "max_model_len": 512,
        "enforce_eager": True,
    }
    assert runner.hidden_states_dir.parent == shm
    assert runner.capture_layer_ids == [6, 1, 3]
    runner.close()
    assert not llm.llm_engine.engine_core.running
    assert not runner.hidden_states_dir.exists()


def test_runner_options_are_the_from_pretrained_keywords_vllm_never_sees():
    parameters = inspect.signature(VLLMRunner.from_pretrained).parameters.values()
    keywords = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
    assert keywords - {"dtype", "capture_layer_ids", "device", "trust_remote_code"} == RUNNER_OPTIONS
    check_engine_args("vllm", {"hidden_states_dir": "/dev/shm", "enforce_eager": "true"})
    with pytest.raises(ModelRefused, match="unknown engine argument no_such_arg"):
        check_engine_args("vllm", {"no_such_arg": 2})


def test_load_runner_passes_engine_kwargs_through(tiny_llama_dir, fake_vllm, shm):
    runner = load_runner(
        "vllm", tiny_llama_dir, dtype="fp32", device="cpu", hidden_states_dir=str(shm), tensor_parallel_size=1
    )
    assert isinstance(runner, VLLMRunner)
    assert fake_vllm.LLM.created[-1].init_kwargs["dtype"] == "float32"
    runner.close()


def test_server_loads_the_vllm_engine_and_passes_its_canary(tiny_qwen3_dir, fake_vllm, shm):
    settings = ServerSettings(
        model=str(tiny_qwen3_dir),
        engine="vllm",
        dtype="float32",
        aux_layer_ids=(0, 2, 5),
        max_model_len=128,
        engine_args={"hidden_states_dir": str(shm), "enforce_eager": True},
    )
    target = load_target(settings)
    assert isinstance(target.runner, VLLMRunner)
    assert target.info.aux_layer_ids == [0, 2, 5] and target.info.engine == "vllm"
    assert (target.info.num_hidden_layers, target.info.hidden_size, target.info.vocab_size) == (
        8,
        HIDDEN,
        256,
    )
    # vLLM keeps one of the 128 slots for the generated token: the server must refuse 128-token rows itself.
    assert target.info.max_model_len == 127
    received = fake_vllm.LLM.created[-1].init_kwargs
    assert (received["max_model_len"], received["enforce_eager"]) == (128, True)
    target.runner.close()


def test_set_capture_layers_restarts_engine_only_for_other_vllm_layers(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm)
    first = fake_vllm.LLM.created[-1]
    runner.set_capture_layers([1, 3, 4])
    runner.set_capture_layers([4, 1, 3])  # the same layers in another order: the same engine
    assert fake_vllm.LLM.created == [first] and runner.capture_layer_ids == [4, 1, 3]
    runner.set_capture_layers([0, 2, 5])
    second = fake_vllm.LLM.created[-1]
    assert second is not first and not first.llm_engine.engine_core.running
    assert second.capture_layers == (1, 3, 6, 8)
    assert runner.capture_layer_ids == [0, 2, 5]
    # The last layer (7) is vLLM's capture id 8, the final state it captures anyway: captured once.
    runner.set_capture_layers([7, 2])
    assert fake_vllm.LLM.created[-1].capture_layers == (3, 8)
    runner.close()


def test_rows_longer_than_max_model_len_minus_one_are_refused(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm, max_model_len=16)
    assert runner.max_prompt_len == 15
    _, aux_states = runner.forward_eagle3(torch.ones(1, 15, dtype=torch.long))
    assert aux_states.shape == (1, 15, 3 * HIDDEN)
    with pytest.raises(ValueError, match=r"a row has 16 tokens; the vLLM engine takes at most 15"):
        runner.forward_eagle3(torch.ones(2, 16, dtype=torch.long))
    runner.close()


def test_left_padding_is_refused(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm)
    with pytest.raises(ValueError, match="right-padded"):
        runner.forward_eagle3(torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1]]))
    runner.close()


# ---- the startup check: the rebuilt logits are vLLM's own ------------------------------------------------


def test_startup_refuses_a_logits_rebuild_that_disagrees_with_vllm(
    tiny_llama_dir, fake_vllm, shm, monkeypatch
):
    def negate_final_state(states, token_ids):
        # As if the model's real final state were not what the rebuild assumes: logits flip sign.
        return torch.cat((states[:, :-1], -states[:, -1:]), dim=1), token_ids

    monkeypatch.setattr(fake_vllm.LLM, "capture_fault", staticmethod(negate_final_state))
    with pytest.raises(ModelRefused, match=r"pick vLLM's greedy token for 0 of 8 prompts"):
        open_runner(tiny_llama_dir, shm)
    (llm,) = fake_vllm.LLM.created
    assert not llm.llm_engine.engine_core.running
    assert list(shm.iterdir()) == []


def test_startup_refuses_a_logit_scale_that_keeps_the_argmax(tiny_llama_dir, fake_vllm, shm, monkeypatch):
    """A scale the config does not name keeps every greedy token, so only logit values reveal it."""
    monkeypatch.setattr(fake_vllm.LLM, "logit_fault", staticmethod(lambda logits: logits * 3.0))
    with pytest.raises(
        ModelRefused, match=r"for 8 of 8 prompts.*vLLM's logits are 3\.000 times the rebuilt ones"
    ):
        open_runner(tiny_llama_dir, shm)
    (llm,) = fake_vllm.LLM.created
    assert not llm.llm_engine.engine_core.running
    assert list(shm.iterdir()) == []


def test_startup_refuses_logits_that_differ_beyond_a_scale(tiny_llama_dir, fake_vllm, shm, monkeypatch):
    """A final norm or head variant the rebuild does not know shifts logits per token: refused at load."""
    offset = torch.randn(256, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(fake_vllm.LLM, "logit_fault", staticmethod(lambda logits: logits + 2.0 * offset))
    with pytest.raises(ModelRefused, match=r"differ from vLLM's by up to"):
        open_runner(tiny_llama_dir, shm)


def test_a_batch_budget_beyond_the_kv_cache_is_refused_at_load(tiny_llama_dir, fake_vllm, shm, monkeypatch):
    """A batch the KV cache cannot hold at once would be split and preempted by vLLM's scheduler after the
    server accepted it: the budget is checked against the cache the engine core allocated."""
    monkeypatch.setattr(fake_vllm.LLM, "kv_cache_tokens", 512)
    with pytest.raises(
        ModelRefused,
        match=r"--max-batch-tokens 1024 is more than the engine's KV cache holds \(512 tokens\): set "
        r"--max-batch-tokens 512 or less, or raise the engine argument gpu_memory_utilization",
    ):
        open_runner(tiny_llama_dir, shm, max_batch_tokens=1024)
    (llm,) = fake_vllm.LLM.created
    assert not llm.llm_engine.engine_core.running
    assert list(shm.iterdir()) == []
    runner = open_runner(tiny_llama_dir, shm, max_batch_tokens=512)
    assert runner.kv_cache_tokens == 512
    runner.close()


def test_an_engine_core_that_exited_is_the_runners_failure(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm)
    assert runner.failure is None
    # What vLLM's engine-core monitor thread sets when the process exits (a worker died, a batch raised).
    fake_vllm.LLM.created[-1].llm_engine.engine_core.resources.engine_dead = True
    assert (
        runner.failure
        == "vLLM's engine core has exited (the log above it says why); vLLM does not restart it"
    )
    runner.close()
    assert runner.failure is not None and "not running" in runner.failure
