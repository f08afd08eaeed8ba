"""The HF runner against a plain transformers forward on the same tiny checkpoints."""

import pytest
import torch
from eagle3_target.runners import ModelRefused, TargetRunner, load_runner, model_info
from eagle3_target.runners.base import ForwardHiddenUnsupported
from eagle3_target.runners.hf import HFRunner
from transformers import AutoModelForCausalLM, GraniteConfig

from support.hidden_states import transformers_states
from support.supervision import token_batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen3_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_eagle3_equals_a_plain_forward_with_hidden_states(model_dir, dtype):
    runner = HFRunner.from_pretrained(model_dir, dtype=dtype, device="cpu", capture_layer_ids=[6, 0, 3])
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    ids = token_batch(0, 2, 12).input_ids
    mask = torch.ones_like(ids)
    logits, aux = runner.forward_eagle3(ids, mask)
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    expected_aux = torch.cat([out.hidden_states[i + 1] for i in (6, 0, 3)], dim=-1)
    assert aux.dtype == DTYPES[dtype] and logits.dtype == out.logits.dtype
    assert aux.shape == (2, 12, 3 * 64) and logits.shape == (2, 12, 256)
    assert torch.equal(aux, expected_aux)
    assert torch.equal(logits, out.logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_hidden_gives_the_normed_final_state_that_the_lm_head_turns_into_the_logits(model_dir, dtype):
    runner = HFRunner.from_pretrained(model_dir, dtype=dtype, device="cpu")
    ids = token_batch(1, 2, 12).input_ids
    logits, aux = runner.forward_eagle3(ids)
    final, aux_again = runner.forward_hidden(ids)
    assert final.shape == (2, 12, 64) and final.dtype == DTYPES[dtype]
    assert torch.equal(aux, aux_again)
    assert torch.equal(torch.nn.functional.linear(final, runner.lm_head_weight()), logits)
    # The final state is the final norm applied to the last decoder layer's output, not that output itself.
    with torch.no_grad():
        last = runner.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(final, last)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_hidden_prenorm_is_the_last_decoder_layer_output_that_the_final_norm_takes(model_dir, dtype):
    runner = HFRunner.from_pretrained(model_dir, dtype=dtype, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    ids = token_batch(5, 2, 12).input_ids
    seen = {}
    last_layer = reference.model.layers[-1]
    handle = last_layer.register_forward_hook(lambda _m, _i, out: seen.setdefault("h", out))
    with torch.no_grad():
        expected_final = reference(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    handle.remove()
    prenorm, aux = runner.forward_hidden(ids, prenorm=True)
    final, aux_post = runner.forward_hidden(ids)
    assert prenorm.dtype == DTYPES[dtype] and prenorm.shape == final.shape
    assert torch.equal(prenorm, seen["h"])
    assert torch.equal(aux, aux_post)
    with torch.no_grad():
        assert torch.equal(reference.model.norm(prenorm), expected_final)
    # Random norm weights make the two differ; with unit weights a mix-up could go unseen.
    assert not torch.allclose(prenorm, final, atol=1e-2)


def test_forward_hidden_prenorm_with_the_last_layer_among_the_captured_layers(tiny_llama_dir):
    runner = HFRunner.from_pretrained(
        tiny_llama_dir, dtype="float32", device="cpu", capture_layer_ids=[7, 1, 3]
    )
    prenorm, aux = runner.forward_hidden(token_batch(6, 2, 12).input_ids, prenorm=True)
    assert torch.equal(aux[..., :64], prenorm)
    assert aux.shape == (2, 12, 192)


def test_right_padding_leaves_the_real_positions_unchanged(model_dir):
    runner = HFRunner.from_pretrained(model_dir, dtype="float32", device="cpu")
    lengths = [12, 7, 3]
    ids = token_batch(2, 3, 12).input_ids
    mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()
    padded_logits, padded_aux = runner.forward_eagle3(ids, mask)
    padded_final, _ = runner.forward_hidden(ids, mask)
    for row, n in enumerate(lengths):
        alone_logits, alone_aux = runner.forward_eagle3(ids[row : row + 1, :n])
        alone_final, _ = runner.forward_hidden(ids[row : row + 1, :n])
        torch.testing.assert_close(padded_logits[row, :n], alone_logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded_aux[row, :n], alone_aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded_final[row, :n], alone_final[0], rtol=1e-5, atol=1e-5)


def test_default_capture_set_is_the_aux_layers_and_any_set_can_follow(tiny_llama_dir):
    runner = HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu")
    assert runner.capture_layer_ids == [1, 3, 4]
    ids = token_batch(0, 1, 5).input_ids
    _, default_aux = runner.forward_eagle3(ids)
    runner.set_capture_layers([4, 3, 1])
    _, reordered = runner.forward_eagle3(ids)
    assert torch.equal(
        reordered, torch.cat([default_aux[..., 128:], default_aux[..., 64:128], default_aux[..., :64]], -1)
    )
    # Any number of layers, the last one (L-1) included: it is h_L, the last state before the final norm.
    runner.set_capture_layers([7, 0, 1, 3, 4, 6])
    _, captured = runner.forward_eagle3(ids)
    want = transformers_states(runner.model, ids, torch.ones_like(ids))
    assert torch.equal(captured, want.captured([7, 0, 1, 3, 4, 6]))
    for bad, reason in (
        ([1, 2, 8], "out of range"),
        ([1, 1], "must be distinct"),
        ([], "1 to 32 layer ids"),
        (list(range(33)), "1 to 32 layer ids"),
    ):
        with pytest.raises(ValueError, match=reason):
            runner.set_capture_layers(bad)
    assert runner.capture_layer_ids == [7, 0, 1, 3, 4, 6]


def test_weights_tied_and_untied(tiny_llama_dir, tiny_qwen3_dir):
    untied = HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu")
    tied = HFRunner.from_pretrained(tiny_qwen3_dir, dtype="float32", device="cpu")
    for runner in (untied, tied):
        assert runner.input_embedding_weight().shape == (256, 64)
        assert runner.lm_head_weight().shape == (256, 64)
        assert runner.final_norm_weight().shape == (64,)
    assert not torch.equal(untied.lm_head_weight(), untied.input_embedding_weight())
    assert torch.equal(tied.lm_head_weight(), tied.input_embedding_weight())


def test_model_info_and_protocol(tiny_qwen3_dir):
    runner = load_runner("hf", tiny_qwen3_dir, dtype="bfloat16", device="cpu", capture_layer_ids=[0, 2, 7])
    assert isinstance(runner, TargetRunner)
    info = model_info(runner)
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (8, 64, 256)
    assert info.dtype == torch.bfloat16 and info.device.type == "cpu"
    assert runner.capture_layer_ids == [0, 2, 7]


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama_dir, tmp_path):
    assert (tiny_llama_dir / "model.safetensors.index.json").is_file()
    runner = HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    reference.save_pretrained(tmp_path)  # one file
    assert (tmp_path / "model.safetensors").is_file()
    single = HFRunner.from_pretrained(tmp_path, dtype="float32", device="cpu")
    ids = token_batch(0, 1, 6).input_ids
    assert torch.equal(runner.forward_eagle3(ids)[0], single.forward_eagle3(ids)[0])


@pytest.mark.parametrize(
    ("ids", "mask", "match"),
    [
        (torch.tensor([[1, 256]]), None, r"\[0, 256\)"),
        (torch.tensor([[-1, 2]]), None, r"\[0, 256\)"),
        (torch.tensor([[1.0, 2.0]]), None, "integers"),
        (torch.tensor([1, 2]), None, r"\[B, S\]"),
        (torch.zeros(1, 0, dtype=torch.long), None, "non-empty"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]]), "right-padded"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, 1]]), "right-padded"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 0]]), "only 0 and 1"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1]]), "shape"),
    ],
)
def test_bad_inputs_are_refused_before_the_forward(tiny_llama_dir, ids, mask, match):
    runner = HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=match):
        runner.forward_eagle3(ids, mask)
    with pytest.raises(ValueError, match=match):
        runner.forward_hidden(ids, mask)


def test_loading_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(ModelRefused, match=r"config\.json"):
        HFRunner.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        HFRunner.from_pretrained(tiny_llama_dir, dtype="float7", device="cpu")
    with pytest.raises(ModelRefused, match="unknown engine"):
        load_runner("trt", tiny_llama_dir, dtype="float32")
    with pytest.raises(ModelRefused, match="no engine arguments"):
        load_runner("hf", tiny_llama_dir, dtype="float32", device="cpu", gpu_memory_utilization=0.5)


def test_close_releases_the_weights(tiny_qwen3_dir):
    runner = HFRunner.from_pretrained(tiny_qwen3_dir, dtype="float32", device="cpu")
    runner.close()
    assert all(p.device.type == "meta" for p in runner.model.parameters())


def test_forward_hidden_refuses_a_model_whose_logits_are_scaled_after_the_lm_head():
    """Granite divides its logits by `logits_scaling`: lm_head(final) alone is the wrong distribution."""
    config = GraniteConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        logits_scaling=8.0,
    )
    torch.manual_seed(0)
    runner = HFRunner(AutoModelForCausalLM.from_config(config), capture_layer_ids=[0, 1, 2])
    ids = torch.randint(0, 128, (1, 6))
    logits, _ = runner.forward_eagle3(ids)
    with pytest.raises(ForwardHiddenUnsupported, match="logits_scaling"):
        runner.forward_hidden(ids)
    prenorm, _ = runner.forward_hidden(ids, prenorm=True)  # claims nothing about the logits: served
    assert prenorm.shape == (1, 6, 32)
    runner.model.config.logits_scaling = 1.0
    final, _ = runner.forward_hidden(ids)
    torch.testing.assert_close(torch.nn.functional.linear(final, runner.lm_head_weight()), logits * 8.0)


@pytest.mark.parametrize(
    ("error", "failure"),
    [
        (torch.AcceleratorError("CUDA error: device-side assert triggered"), "lost its device: Accelerator"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), None),
        (RuntimeError("an engine bug"), None),
    ],
)
def test_only_a_lost_device_is_the_runners_failure(tiny_llama_dir, error, failure):
    """A CUDA error poisons the process's CUDA context for good; running out of memory fails one batch."""
    runner = HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu")
    assert runner.failure is None

    def fault(*_args: object) -> None:
        raise error

    handle = runner.model.model.layers[2].register_forward_hook(fault)
    with pytest.raises(type(error)):
        runner.forward_eagle3(token_batch(0).input_ids)
    handle.remove()
    assert (runner.failure is None) if failure is None else (failure in (runner.failure or ""))
