"""SpecForge 0.2 (the real package) trains on `eagle3-target export specforge` files exactly as on the files
its own SGLang capture would have written (the reference: a plain transformers forward per row, as SGLang
captures; see support/trainer_rows.py).

CPU shims, only here, for lines of SpecForge that need CUDA or a GPU compiler:
- `specforge.algorithms.eagle3.model.LogSoftmaxLoss` is a Triton kernel; it is replaced by the same KL in
  torch: mean over positions of -sum(target * log_softmax(logits)) * position_mask;
- `torch.compile` (SpecForge decorates its draft's RoPE and RMSNorm) is disabled: on CPU its inductor
  build takes minutes per graph. Both runs under comparison train with identical settings.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from eagle3_target.client.target_client import TargetClient
from eagle3_target.integrations.exporter import export
from eagle3_target.integrations.layouts import SpecForgeLayout
from eagle3_target.integrations.rows import JsonlRows
from transformers import AutoModelForCausalLM

from support.trainer_rows import write_sglang_files

MAX_LEN = 64
# SpecForge's own tiny EAGLE-3 draft for H=64, V=256 (its tests' TINY_DRAFT_CONFIG).
DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 256,
    "draft_vocab_size": 64,
}


@pytest.fixture(scope="module")
def feature_dirs(bf16_server, bf16_model_dir, rows, rows_jsonl, tmp_path_factory) -> dict[str, Path]:
    """`served`: exported from the server (one unpadded row per request, as SGLang runs them);
    `reference`: written the way SGLang's capture would."""
    root = tmp_path_factory.mktemp("specforge-features")
    with TargetClient(bf16_server.url) as client:
        export(
            client, JsonlRows(rows_jsonl), SpecForgeLayout(), root / "served", batch_tokens=48, progress=False
        )
    model = AutoModelForCausalLM.from_pretrained(bf16_model_dir, dtype=torch.bfloat16).eval()
    write_sglang_files(model, rows, [1, 3, 4], root / "reference")
    return {"served": root / "served", "reference": root / "reference"}


@pytest.fixture
def cpu_shims(monkeypatch):
    import specforge.algorithms.eagle3.model as eagle3_model

    class TorchKL:
        @staticmethod
        def apply(logits, target, position_mask):
            per_position = -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
            return (per_position * position_mask.squeeze(-1)).mean()

    monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss", TorchKL)
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    monkeypatch.setenv("SPECFORGE_DEVICE", "cpu")


def loader_batches(directory: Path, model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """SpecForge's offline path: its file listing and loader, the eagle3 normaliser, its collator, then the
    frozen TargetHead's shift and lm_head projection (what the strategy does before the draft forward)."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files
    from specforge.training.strategies.base import _prepare_eagle_target

    normalize = build_offline_normalizer(MAX_LEN)
    collate = build_offline_collator()
    head = TargetHead.from_pretrained(str(model_dir), lm_head_key="lm_head.weight")
    files = list_feature_files(str(directory))
    assert len(files) == 12
    batches = []
    for start in range(0, len(files), 2):
        batch = collate([normalize(load_feature_file(path)) for path in files[start : start + 2]])
        ids, logits, loss_mask = _prepare_eagle_target(
            target_head=head,
            target_repr="hidden_state",
            input_ids=batch["input_ids"],
            target=batch["target"],
            loss_mask=batch["loss_mask"],
            device=torch.device("cpu"),
        )
        batches.append(
            {**batch, "shifted_input_ids": ids, "target_logits": logits, "shifted_loss_mask": loss_mask}
        )
    return batches


def test_specforges_loader_builds_the_same_batches_from_served_files(feature_dirs, bf16_model_dir):
    served = loader_batches(feature_dirs["served"], bf16_model_dir)
    reference = loader_batches(feature_dirs["reference"], bf16_model_dir)
    for got, want in zip(served, reference, strict=True):
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), name
    assert served[0]["target_logits"].shape[-1] == 256 and served[0]["hidden_state"].dtype == torch.bfloat16


def train(features: Path, model_dir: Path, out: Path, capsys) -> list[dict[str, float]]:
    """Two optimizer steps of `specforge train` (offline, colocated), returning its logged metrics."""
    from specforge.cli import main

    out.mkdir()
    (out / "draft.json").write_text(json.dumps(DRAFT_CONFIG))
    config = {
        "model": {
            "target_model_path": str(model_dir),
            "draft_model_config": str(out / "draft.json"),
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": str(features),
            "max_length": MAX_LEN,
            "dataloader_num_workers": 0,
            "cache_dir": str(out / "cache"),  # its vocab mapping cache, else ./cache
        },
        "training": {
            "strategy": "eagle3",
            "max_steps": 2,
            "ttt_length": 3,
            "attention_backend": "sdpa",
            "fsdp_sharding": "NO_SHARD",
            "log_interval": 1,
        },
        "output_dir": str(out / "run"),
    }
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    environment = dict(os.environ)
    try:
        assert main(["train", "--config", str(out / "config.yaml")]) == 0
    finally:
        # SpecForge's launcher exports its worker env (RANK, LOCAL_RANK, ...) and leaves its gloo group up;
        # neither may leak into the tests that run after this one in the same process.
        os.environ.clear()
        os.environ.update(environment)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    printed = capsys.readouterr().out
    steps = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", printed, flags=re.M)]
    return [{k: v for k, v in step.items() if not k.startswith("perf/")} for step in steps]


def test_two_specforge_training_steps_give_the_same_losses_and_weights(
    feature_dirs, bf16_model_dir, tmp_path, cpu_shims, capsys
):
    served = train(feature_dirs["served"], bf16_model_dir, tmp_path / "served", capsys)
    reference = train(feature_dirs["reference"], bf16_model_dir, tmp_path / "reference", capsys)
    assert len(served) == 2 and served == reference
    # A batch whose supervised positions all have their target token outside the draft vocabulary has
    # loss 0 (random tiny models make some); the weights after both steps must still have moved the same.
    assert any(step["loss"] > 0 for step in served), served
    states = [
        torch.load(tmp_path / name / "run" / "specforge-run-step2" / "training_state.pt", weights_only=False)
        for name in ("served", "reference")
    ]
    tensors = [{k: v for k, v in flatten(state).items() if isinstance(v, torch.Tensor)} for state in states]
    assert tensors[0].keys() == tensors[1].keys() and len(tensors[0]) > 10
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix: value}
