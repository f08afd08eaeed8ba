"""Reading a target's output-side weights straight from its safetensors checkpoint."""

from __future__ import annotations

import pytest
import torch
from eagle3_target.runners.checkpoint import load_head_weights, tensor_files
from eagle3_target.runners.hf import HFRunner
from eagle3_target.tiny import write_tiny_model
from safetensors.torch import save_file

HIDDEN = 64


def test_sharded_checkpoint_head_weights_match_the_model(tmp_path):
    model_dir = write_tiny_model(tmp_path / "sharded", arch="llama", num_layers=4, max_shard_size="20KB")
    files = tensor_files(model_dir)
    assert len(set(files.values())) > 1, "the checkpoint should be sharded"
    hf = HFRunner.from_pretrained(model_dir, dtype="float32", device="cpu", capture_layer_ids=[0, 1, 2])
    weights = load_head_weights(
        model_dir,
        vocab_size=256,
        hidden_size=HIDDEN,
        tie_word_embeddings=False,
        dtype=torch.float32,
        device="cpu",
    )
    assert torch.equal(weights.input_embeddings, hf.input_embedding_weight())
    assert torch.equal(weights.lm_head, hf.lm_head_weight())
    assert not torch.equal(weights.lm_head, weights.input_embeddings)
    assert torch.equal(weights.final_norm, hf.final_norm_weight())


def test_checkpoint_errors(tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors"):
        tensor_files(tmp_path)
    common = {"hidden_size": HIDDEN, "tie_word_embeddings": False, "dtype": torch.float32, "device": "cpu"}
    with pytest.raises(ValueError, match=r"input embeddings has shape \(256, 64\), expected \(512, 64\)"):
        load_head_weights(tiny_llama_dir, vocab_size=512, **common)
    untied_without_head = tmp_path / "no-lm-head"
    untied_without_head.mkdir()
    weights = {"model.embed_tokens.weight": torch.zeros(256, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    save_file(weights, untied_without_head / "model.safetensors")
    with pytest.raises(ValueError, match="untied embeddings but no LM head"):
        load_head_weights(untied_without_head, vocab_size=256, **common)
    padded = load_head_weights(tiny_llama_dir, vocab_size=200, **common)
    assert padded.lm_head.shape == (200, HIDDEN), "rows past vocab_size are padding and are trimmed"
