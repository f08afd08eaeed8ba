"""The vLLM runner against a stand-in `vllm` (support/fake_vllm.py) fed by real forwards.

The reference is the HF runner on the same checkpoint. Tolerance: the models are fp32 and the rebuild
applies the same RMSNorm and LM head formulas as transformers, so the only difference is matmul rounding:
the stand-in runs each row unpadded (as vLLM does) while the HF runner runs the padded batch, and the two
shapes accumulate in a different order. That measured at most 4e-6 here; we allow 1e-5.
"""

from __future__ import annotations

import inspect
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import torch
from eagle3_target.runners import ModelRefused, TargetRunner, check_engine_args, load_runner, model_info
from eagle3_target.runners.hf import HFRunner
from eagle3_target.runners.vllm import VLLMRunner
from eagle3_target.runners.vllm_args import ENGINE_ARG_PARSERS, RUNNER_OPTIONS, RUNNER_OWNED_ARGS
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.target import load_target

from support import fake_vllm as stand_in

ATOL = 1e-5
HIDDEN = 64


@pytest.fixture
def fake_vllm(monkeypatch) -> ModuleType:
    """`vllm` is the stand-in for the duration of the test (the runner imports it lazily)."""
    stand_in.install(monkeypatch)
    return stand_in


@pytest.fixture
def shm(tmp_path) -> Path:
    """Stands in for /dev/shm: the runner's capture files must all be gone after each call."""
    path = tmp_path / "shm"
    path.mkdir()
    return path


def ragged_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded rows of lengths 11, 7 and 3 (padding ids are arbitrary, masked out)."""
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, vocab_size, (3, 11), generator=gen)
    lengths = torch.tensor([11, 7, 3])
    mask = (torch.arange(11)[None, :] < lengths[:, None]).long()
    return input_ids, mask


def open_runner(model_dir: Path, shm: Path, **kwargs) -> VLLMRunner:
    return VLLMRunner.from_pretrained(
        model_dir, dtype="float32", device="cpu", hidden_states_dir=shm, **kwargs
    )


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_matches_hf_runner_on_ragged_batch(model_dir, model_impl, request, fake_vllm, shm):
    """On both of vLLM's backends: native classes write the layers ascending, the Transformers backend in
    the order it was given (review B1), so aux ids that are not ascending must still come back in order."""
    path = request.getfixturevalue(model_dir)
    aux = [5, 0, 3]
    hf = HFRunner.from_pretrained(path, dtype="float32", device="cpu", aux_layer_ids=aux)
    runner = open_runner(path, shm, aux_layer_ids=aux, model_impl=model_impl)
    assert fake_vllm.LLM.created[-1].backend == ("transformers" if model_impl == "transformers" else "vllm")
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
    assert runner.aux_layer_ids == hf.aux_layer_ids == [1, 3, 4]
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
        aux_layer_ids=[6, 1, 3],
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
            # Sorted, so the file order is ascending on every backend (review B1).
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
    assert runner.aux_layer_ids == [6, 1, 3]
    runner.close()
    assert not llm.llm_engine.engine_core.running
    assert not runner.hidden_states_dir.exists()


def test_runner_options_are_the_from_pretrained_keywords_vllm_never_sees():
    parameters = inspect.signature(VLLMRunner.from_pretrained).parameters.values()
    keywords = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
    assert keywords - {"dtype", "aux_layer_ids", "device", "trust_remote_code"} == RUNNER_OPTIONS
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
    assert (target.num_hidden_layers, target.hidden_size, target.vocab_size) == (8, HIDDEN, 256)
    # vLLM keeps one of the 128 slots for the generated token: the server must refuse 128-token rows itself.
    assert target.max_model_len == target.info.max_model_len == 127
    received = fake_vllm.LLM.created[-1].init_kwargs
    assert (received["max_model_len"], received["enforce_eager"]) == (128, True)
    target.runner.close()


def test_set_aux_layers_restarts_engine_only_on_change(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm)
    first = fake_vllm.LLM.created[-1]
    runner.set_aux_layers([1, 3, 4])
    assert fake_vllm.LLM.created == [first]
    runner.set_aux_layers([0, 2, 5])
    second = fake_vllm.LLM.created[-1]
    assert second is not first and not first.llm_engine.engine_core.running
    assert second.capture_layers == (1, 3, 6, 8)
    assert runner.aux_layer_ids == [0, 2, 5]
    runner.close()


def test_last_decoder_layer_is_refused(tiny_llama_dir, fake_vllm, shm):
    with pytest.raises(ValueError, match=r"aux layer id 7 .*final pre-norm"):
        open_runner(tiny_llama_dir, shm, aux_layer_ids=[1, 3, 7])
    assert fake_vllm.LLM.created == []
    assert list(shm.iterdir()) == [], "a failed start must not leave its capture directory behind"


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


def zero_layer(states, token_ids):
    states = states.clone()
    states[:, 1] = 0
    return states, token_ids


def nan_value(states, token_ids):
    states = states.clone()
    states[2, 0, 5] = float("nan")
    return states, token_ids


def drop_last_position(states, token_ids):
    return states[:-1], token_ids[:-1]


def other_tokens(states, token_ids):
    return states, (token_ids + 1) % 256


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (zero_layer, r"all-zero hidden states at file slot\(s\) \[1\]"),
        (nan_value, r"non-finite"),
        (drop_last_position, r"captured 10 positions .* for a 11-token prompt"),
        (other_tokens, r"token_ids differ from the prompt"),
    ],
)
def test_bad_captures_are_refused_and_files_removed(
    tiny_llama_dir, fake_vllm, shm, monkeypatch, fault, message
):
    runner = open_runner(tiny_llama_dir, shm)
    # One slow writer thread: rows 1-2 are still being written when row 0 fails; their files must be
    # deleted after the writes end, or they reappear.
    llm = fake_vllm.LLM.created[-1]
    llm.writer = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(fake_vllm.LLM, "capture_fault", staticmethod(fault))
    input_ids, mask = ragged_batch(256)
    with pytest.raises(RuntimeError, match=message):
        runner.forward_eagle3(input_ids, mask)
    assert not any(runner.hidden_states_dir.iterdir()), "every row's file must be removed after a failure"
    # The engine keeps serving once the fault is gone.
    monkeypatch.setattr(fake_vllm.LLM, "capture_fault", None)
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert torch.isfinite(aux_states).all()
    assert not any(runner.hidden_states_dir.iterdir()), "no write of the failed call may land afterwards"
    runner.close()


def test_rows_longer_than_max_model_len_minus_one_are_refused(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm, max_model_len=16)
    assert runner.max_prompt_len == 15
    _, aux_states = runner.forward_eagle3(torch.ones(1, 15, dtype=torch.long))
    assert aux_states.shape == (1, 15, 3 * HIDDEN)
    with pytest.raises(ValueError, match=r"a row has 16 tokens; the vLLM engine takes at most 15"):
        runner.forward_eagle3(torch.ones(2, 16, dtype=torch.long))
    runner.close()


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


def test_left_padding_is_refused(tiny_llama_dir, fake_vllm, shm):
    runner = open_runner(tiny_llama_dir, shm)
    with pytest.raises(ValueError, match="right-padded"):
        runner.forward_eagle3(torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1]]))
    runner.close()


# ---- what a read of vLLM 0.33's source found (review-vllm-runner.md, B1-B5) ------------------------------


def copy_model(source: Path, target: Path, **config_changes) -> Path:
    """A copy of a tiny checkpoint with config.json changed (weights shared as they are)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


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


def test_startup_refuses_a_logit_scale_that_keeps_the_argmax(tiny_llama_dir, fake_vllm, shm, monkeypatch):
    """A scale the config does not name (B2) keeps every greedy token, so only logit values reveal it."""
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
    reading them would block forever (B4)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelRefused, match=r"VLLM_ENABLE_V1_MULTIPROCESSING"):
        open_runner(tiny_llama_dir, shm, **engine_args)
    assert fake_vllm.LLM.created == []


@pytest.mark.timeout(60)
def test_a_write_that_never_ends_is_a_bounded_error_and_the_engine_keeps_serving(
    tiny_llama_dir, fake_vllm, shm
):
    runner = open_runner(tiny_llama_dir, shm, capture_timeout_s="0.5")
    llm = fake_vllm.LLM.created[-1]
    llm.stall_write_rows = {1}
    input_ids, mask = ragged_batch(256)
    with pytest.raises(
        RuntimeError, match=r"row 1: vLLM's connector did not finish writing .* within 0\.5 s"
    ):
        runner.forward_eagle3(input_ids, mask)
    llm.stall_write_rows = set()
    # The next batch is served while the stalled write is still pending.
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert torch.isfinite(aux_states).all()
    assert len(list(runner.hidden_states_dir.iterdir())) == 1, "only the stalled write's lock is left"
    # When the write finally lands, the next batch removes its file and lock.
    llm.release_stalled_writes()
    runner.forward_eagle3(input_ids, mask)
    assert not any(runner.hidden_states_dir.iterdir())
    runner.close()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        # vLLM only logs a failed write (`_on_write_done`) and releases the lock: no file appears.
        ("fail_write_rows", r"row 1: vLLM's connector wrote no capture file"),
        # An aborted request comes back without a token, but its file is still written (B5).
        ("abort_rows", r"row 1: vLLM returned no token \(finish reason: abort\)"),
    ],
)
def test_a_failed_write_or_aborted_request_is_a_clear_error_and_leaks_no_files(
    tiny_llama_dir, fake_vllm, shm, fault, message
):
    runner = open_runner(tiny_llama_dir, shm)
    llm = fake_vllm.LLM.created[-1]
    setattr(llm, fault, {1})
    input_ids, mask = ragged_batch(256)
    with pytest.raises(RuntimeError, match=message):
        runner.forward_eagle3(input_ids, mask)
    assert not any(runner.hidden_states_dir.iterdir()), "every row's file must be removed after a failure"
    setattr(llm, fault, set())
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert torch.isfinite(aux_states).all()
    runner.close()


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


# ---- the stand-in is as strict as vLLM 0.33 ---------------------------------------------------------------


def test_every_engine_argument_the_runner_passes_exists_in_vllm_0_33(fake_vllm):
    assert set(ENGINE_ARG_PARSERS) <= fake_vllm.ENGINE_ARGS
    assert set(RUNNER_OWNED_ARGS) <= fake_vllm.ENGINE_ARGS
    assert {"skip_tokenizer_init", "max_logprobs"} <= fake_vllm.ENGINE_ARGS


def stand_in_engine(model_dir: Path, shm: Path, capture_ids: list[int], **kwargs) -> object:
    return stand_in.LLM(
        str(model_dir),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_ids}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(shm)},
        },
        **kwargs,
    )


@pytest.mark.parametrize(
    ("capture_ids", "kwargs", "error", "message"),
    [
        ([2, 4, 8], {"max_num_seq": 4}, TypeError, r"unexpected keyword argument 'max_num_seq'"),
        ([2, 2, 8], {}, RuntimeError, r"Expected 3 auxiliary hidden states, got 2"),
        (
            [2, 2, 8],
            {"model_impl": "transformers"},
            RuntimeError,
            r"Expected 3 auxiliary hidden states, got 2",
        ),
        ([], {}, ValueError, r"eagle_aux_hidden_state_layer_ids must be set"),
        (
            [2, 4, 8],
            {"pipeline_parallel_size": 2},
            RuntimeError,
            r"Expected 1 CacheOnlyAttentionLayer, got 0",
        ),
    ],
)
def test_the_stand_in_fails_where_vllm_does(
    tiny_llama_dir, fake_vllm, shm, capture_ids, kwargs, error, message
):
    with pytest.raises(error, match=message):
        stand_in_engine(tiny_llama_dir, shm, capture_ids, **kwargs)


def test_the_stand_in_writes_in_given_order_on_the_transformers_backend(tiny_llama_dir, fake_vllm, shm):
    native = stand_in_engine(tiny_llama_dir, shm, [7, 2, 8])
    transformers_backend = stand_in_engine(tiny_llama_dir, shm, [7, 2, 8], model_impl="transformers")
    assert native.capture_layers == (2, 7, 8) and transformers_backend.capture_layers == (7, 2, 8)
    params = fake_vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=21)
    with pytest.raises(ValueError, match=r"greater than max allowed: 20"):
        native.generate([{"prompt_token_ids": [1, 2, 3]}], params)
