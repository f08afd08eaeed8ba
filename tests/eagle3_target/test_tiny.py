"""Tiny model writer and its CLI command."""

import json

import pytest
import torch
from eagle3_target.cli import app
from eagle3_target.tiny import write_tiny_model
from safetensors.torch import load_file
from typer.testing import CliRunner


def _weights(model_dir):
    return load_file(model_dir / "model.safetensors")


def test_cli_writes_a_loadable_model(tmp_path):
    from eagle3_target.runners.hf import HFRunner

    out = tmp_path / "m"
    result = CliRunner().invoke(
        app, ["tiny-model", str(out), "--arch", "qwen3", "--layers", "7", "--hidden", "32", "--vocab", "128"]
    )
    assert result.exit_code == 0, result.output
    assert str(out) in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (7, 32, 128)
    runner = HFRunner.from_pretrained(out, device="cpu")
    assert runner.capture_layer_ids == [1, 2, 3]
    logits, aux = runner.forward_eagle3(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 128) and aux.shape == (1, 3, 96)


def test_cli_reports_bad_parameters(tmp_path):
    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "m"), "--hidden", "34"])
    assert result.exit_code == 2
    assert "multiple of 4" in result.output
    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "m"), "--arch", "gpt2"])
    assert result.exit_code == 2


def test_llama_is_untied_and_the_seed_fixes_the_weights(tmp_path):
    a = _weights(write_tiny_model(tmp_path / "a", num_layers=2, seed=3))
    b = _weights(write_tiny_model(tmp_path / "b", num_layers=2, seed=3))
    c = _weights(write_tiny_model(tmp_path / "c", num_layers=2, seed=4))
    assert "lm_head.weight" in a
    assert not torch.equal(a["lm_head.weight"], a["model.embed_tokens.weight"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_dtype_and_sharding(tmp_path):
    out = write_tiny_model(tmp_path / "bf16", num_layers=2, dtype="bfloat16", max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all(load_file(out / s)[k].dtype == torch.bfloat16 for s in shards for k in load_file(out / s))


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        write_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="concrete"):
        write_tiny_model(tmp_path, dtype="auto")


def test_norm_weights_are_random_so_a_double_norm_shows(tmp_path):
    weights = _weights(write_tiny_model(tmp_path / "m", arch="qwen3", num_layers=2))
    norms = {k: w for k, w in weights.items() if k.endswith("norm.weight")}
    assert "model.norm.weight" in norms and len(norms) == 9  # 4 per layer (qwen3 has q/k norms) + final
    for name, weight in norms.items():
        assert not torch.equal(weight, torch.ones_like(weight)), name
        assert bool((weight > 0).all()), name
