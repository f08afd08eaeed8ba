"""speculators 0.9 (the real package) trains on a served target, online through the `eagle3-target`
hidden-states backend and offline on `eagle3-target export speculators` files, for every draft method it
trains (EAGLE-3, P-EAGLE, DFlash, DSpark, MTP; their layers from methods.py, captured by the target):
- bit-exact against files written the way vLLM captures (a plain transformers forward per row, bf16; see
  support/trainer_rows.py): the exported files of every method, EAGLE-3's loader batches and losses, and a
  DFlash draft trained on a target found by name;
- against speculators' own `generate-offline-data` on vLLM's CPU build (fp32, support/vllm_datagen.py):
  two online steps of each method give its losses on vLLM's files, to vLLM's agreement with transformers.

CPU shims, only here, for speculators lines that assume CUDA (speculators/train/trainer.py, train/cli.py):
- `Trainer` moves model and batches with `.to(local_rank)` (an int: a CUDA device): `get_local_rank` -> "cpu";
- its autocast device and the exit cleanup come from `torch.accelerator.current_accelerator()`, None on a
  machine without one (then "cuda"): it answers the CPU, whose `empty_cache` is a no-op stub;
- its step timer calls `torch.accelerator.synchronize()` / `is_available()`: no-ops.
Flags that keep speculators off CUDA-only paths: `--draft-attn-impl sdpa`, `--loss-implementation eager`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import eagle3_target.integrations.speculators as backend  # registers the backend before speculators' CLI
import pytest
import torch
from eagle3_target.client.target_client import TargetClient
from eagle3_target.integrations.exporter import export
from eagle3_target.integrations.layouts import SpeculatorsLayout
from eagle3_target.integrations.rows import PreparedRows
from eagle3_target.methods import method, vllm_capture_ids
from eagle3_target.tiny import write_tiny_model
from safetensors.torch import load_file

from support.server_process import ServerProcess, start_server
from support.targets import create_target, target_status, write_status
from support.trainer_rows import (
    CAPTURE_LAYER_IDS,
    MAX_BATCH_TOKENS,
    MAX_MODEL_LEN,
    add_mtp_head,
    write_vllm_files,
)
from support.vllm_datagen import generate_offline_data, select_capture_ids, vllm_server

NUM_LAYERS = 8  # the tiny Llamas'
# What vLLM captures for speculators' data generation: every method's vLLM ids (our captured layers + 1), L.
DATAGEN_CAPTURE_IDS = [*vllm_capture_ids(CAPTURE_LAYER_IDS), NUM_LAYERS]
# Losses online vs on vLLM's files: the features agree to about 1e-5 (fp32), then both are cast to bf16.
LOSS_RTOL = 1e-3

TOTAL_SEQ_LEN = 128


@pytest.fixture(scope="module", autouse=True)
def thread_settings():
    """speculators' dataloader sets OMP/MKL/OPENBLAS_NUM_THREADS=1 in os.environ and torch's thread count to 1
    (speculators/train/dataloader.py); servers started later would inherit one thread and differ from
    in-process forwards by fp32 reduction order, so both are restored."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    yield
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(scope="module")
def files(bf16_server, rows, plain_model, tmp_path_factory) -> dict[str, Path]:
    """`prepared`: speculators' own prepare-data output for the rows; `served`: exported from it by the
    server (one unpadded row per request, as vLLM runs them); `reference`: vLLM-style capture files."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    root = tmp_path_factory.mktemp("speculators")
    prepared = build_speculator_training_dataset(
        Dataset.from_list(rows), processor=None, max_length=64, num_proc=1
    )
    prepared.save_to_disk(str(root / "prepared"))
    with TargetClient(bf16_server.url) as client:
        export(
            client,
            PreparedRows(root / "prepared"),
            SpeculatorsLayout(),
            root / "served",
            batch_tokens=48,
            progress=False,
        )
    write_vllm_files(plain_model, rows, [2, 4, 5, 8], root / "reference")
    return {
        "prepared": root / "prepared",
        "served": root / "served" / "hidden_states",
        "reference": root / "reference" / "hidden_states",
    }


def method_capture_ids(name: str) -> list[int]:
    """The vLLM capture ids of a method's speculators file on the tiny target: its layers + 1, then L."""
    return [*vllm_capture_ids(method(name).default_layer_ids(NUM_LAYERS)), NUM_LAYERS]


def publish(objects, namespace: str, name: str, url: str) -> None:
    """Play the operator: an Eagle3Target whose status names the server at `url` as its ready endpoint."""
    with TargetClient(url) as client:
        fingerprint = client.info().fingerprint
    published = target_status(1, "True", "AllReplicasReady")
    published["model"] = published["model"] | {"fingerprint": fingerprint}
    published["endpoints"] = [{"pod": f"{name}-0", "address": url, "ready": True, "node": "n0"}]
    create_target(objects, namespace, name)
    write_status(objects, namespace, name, published)


def plugin_args(url: str | None, **overrides) -> argparse.Namespace:
    values = {
        "speculator_type": "eagle3",
        "eagle3_target": url,
        "eagle3_target_namespace": None,
        "eagle3_target_token_file": None,
        "eagle3_target_kubeconfig": None,
        "target_layer_ids": None,
        "from_pretrained": None,
    }
    return argparse.Namespace(**{**values, **overrides})


def loader_batches(transfer, prepared: Path) -> list[dict]:
    """speculators' own dataset and collator (with eagle3's shift_batch), 3 rows per packed batch."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    dataset = ArrowDataset(max_len=TOTAL_SEQ_LEN, datapath=prepared, transfer=transfer, on_missing="raise")
    collate = CollateFn(TOTAL_SEQ_LEN, 64, preprocess=shift_batch)
    return [collate([dataset[i] for i in range(start, start + 3)]) for start in range(0, len(dataset), 3)]


def test_speculators_loader_builds_the_same_batches_from_files_and_online(files, bf16_server, plain_model):
    from hs_connectors import FileTransfer

    online = backend.Eagle3TargetBackend.from_train_args(plugin_args(bf16_server.url), str(files["prepared"]))
    online = pickle.loads(pickle.dumps(online))  # as a spawned DataLoader worker gets it
    reference = loader_batches(FileTransfer(files["reference"]), files["prepared"])
    for transfer in (FileTransfer(files["served"]), online):
        for got, want in zip(loader_batches(transfer, files["prepared"]), reference, strict=True):
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
                    assert torch.equal(got[name], value), name
                else:
                    assert got[name] == value, name
    assert pickle.loads(pickle.dumps(online))._client is None  # the client never travels to a worker
    # Slot 4 is h_L before the final norm: speculators' verifier_norm turns it into the target's final state.
    last = reference[0]["verifier_last_hidden_states"]
    with torch.no_grad():
        normed = plain_model.model.norm(last)
    assert not torch.allclose(normed.float(), last.float(), atol=1e-2)


@pytest.mark.parametrize("name", ["eagle3", "peagle", "dflash", "dspark", "mtp"])
def test_export_writes_each_methods_files_as_vllm_does(name, bf16_server, plain_model, rows, files, tmp_path):
    """`--method NAME`: the method's default layers + 1 as vLLM capture ids, then L (MTP: only L)."""
    with TargetClient(bf16_server.url) as client:
        export(
            client, PreparedRows(files["prepared"]), SpeculatorsLayout(method=name), tmp_path / "served",
            batch_tokens=48, progress=False,
        )  # fmt: skip
    capture_ids = method_capture_ids(name)
    reference = write_vllm_files(plain_model, rows, capture_ids, tmp_path / "reference")
    assert capture_ids[-1] == NUM_LAYERS and (name != "mtp" or capture_ids == [NUM_LAYERS])
    for i in range(len(rows)):
        got = load_file(tmp_path / "served" / "hidden_states" / f"hs_{i}.safetensors")
        want = load_file(reference / f"hs_{i}.safetensors")
        assert got["hidden_states"].shape == want["hidden_states"].shape == (
            len(rows[i]["input_ids"]), len(capture_ids), plain_model.config.hidden_size
        )  # fmt: skip
        assert torch.equal(got["hidden_states"], want["hidden_states"]) and torch.equal(
            got["token_ids"], want["token_ids"]
        )


def test_the_plugin_refuses_a_draft_whose_layers_the_target_does_not_capture(files, bf16_server, tmp_path):
    prepared = str(files["prepared"])
    captured_vllm = str([i + 1 for i in CAPTURE_LAYER_IDS])
    # vLLM id 1 is our layer 0, which the target does not capture.
    with pytest.raises(ValueError, match=r"target layer ids \[1, 4, 5\]") as refused:
        backend.Eagle3TargetBackend.from_train_args(
            plugin_args(bf16_server.url, target_layer_ids=[1, 4, 5]), prepared
        )
    assert str(CAPTURE_LAYER_IDS) in str(refused.value) and captured_vllm in str(refused.value)
    (tmp_path / "config.json").write_text(json.dumps({"aux_hidden_state_layer_ids": [2, 3, 4, 5, 1]}))
    with pytest.raises(ValueError, match=r"lacks \[0\]"):
        backend.Eagle3TargetBackend.from_train_args(
            plugin_args(bf16_server.url, speculator_type="dflash", from_pretrained=str(tmp_path)), prepared
        )
    with pytest.raises(ValueError, match=r"vLLM capture ids \[0\] cannot be served"):
        backend.Eagle3TargetBackend.from_train_args(
            plugin_args(bf16_server.url, target_layer_ids=[0, 4, 5]), prepared
        )
    # Captured layers, L among them (the last slot), and MTP's [L] are served.
    for args in (
        plugin_args(bf16_server.url, target_layer_ids=[2, 7, 8]),
        plugin_args(bf16_server.url, speculator_type="mtp", target_layer_ids=[1]),  # MTP ignores them
    ):
        assert backend.Eagle3TargetBackend.from_train_args(args, prepared)
    with pytest.raises(ValueError, match="needs --eagle3-target"):
        backend.Eagle3TargetBackend.from_train_args(plugin_args(None), prepared)


def test_speculators_training_stops_before_its_first_step_on_layers_the_target_lacks(
    files, bf16_model_dir, bf16_server, tmp_path, cpu_shims, monkeypatch
):
    """Through speculators' own `train`: the refusal comes before any step is logged or anything saved."""
    argv = train_argv(
        "dflash", bf16_model_dir, files["prepared"], tmp_path / "save",
        "--num-workers", "0", "--hidden-states-backend", "eagle3-target", "--eagle3-target", bf16_server.url,
        "--target-layer-ids", "1", "4", "5", "6", "7",  # vLLM id 1 is our layer 0, not captured
    )  # fmt: skip
    logged: list[dict] = []
    with pytest.raises(ValueError, match=r"target layer ids \[1, 4, 5, 6, 7\]") as refused:
        train(argv, monkeypatch, logged)
    assert str(CAPTURE_LAYER_IDS) in str(refused.value) and "lacks [0]" in str(refused.value)
    assert logged == []
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").rglob("*.safetensors"))


@pytest.fixture
def cpu_shims(monkeypatch):
    import speculators.train.trainer as trainer

    monkeypatch.setattr(trainer, "get_local_rank", lambda: "cpu")
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cpu")
    )
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)


def train(argv: list[str], monkeypatch, logged: list[dict] | None = None) -> list[dict]:
    """Two optimizer steps and a validation pass of speculators' own training CLI; its logged metrics (also
    in `logged` as they come, for a run that raises)."""
    import speculators.train.trainer as trainer

    logged = [] if logged is None else logged
    metric_logger = trainer.metric_logger

    def record(message, *args, **kwargs):
        if isinstance(message, dict) and ("train" in message or "val" in message):  # not the run config
            logged.append({k: v for k, v in message.items() if k != "profile"})
        return logging.Logger.info(metric_logger, message, *args, **kwargs)

    monkeypatch.setattr(trainer.metric_logger, "info", record)
    backend.main(argv)
    return logged


def train_argv(speculator_type: str, verifier: Path, prepared: Path, save: Path, *source: str) -> list[str]:
    """speculators' `train` flags for two steps of a tiny draft of this type on the CPU. MTP takes neither
    layer ids (it reads only L), an attention choice nor a mask token (speculators refuses them)."""
    layer_ids = [str(k) for k in vllm_capture_ids(method(speculator_type).default_layer_ids(NUM_LAYERS))]
    draft = ["--target-layer-ids", *layer_ids, "--draft-attn-impl", "sdpa", "--mask-token-id", "0"]
    own = {
        "eagle3": draft,
        "peagle": [*draft, "--max-anchors", "32"],
        "dflash": [*draft, "--block-size", "4", "--max-anchors", "16", "--num-layers", "1"],
        "dspark": [*draft, "--block-size", "4", "--max-anchors", "16", "--num-layers", "1"],
        "mtp": [],
    }[speculator_type]
    return [
        "--speculator-type", speculator_type,
        "--verifier-name-or-path", str(verifier),
        "--data-path", str(prepared),
        "--save-path", str(save),
        "--loss-implementation", "eager",
        "--total-seq-len", str(TOTAL_SEQ_LEN),
        "--epochs", "1",
        "--max-steps", "2",
        "--log-freq", "1",
        "--on-missing", "raise",
        *own,
        *source,
    ]  # fmt: skip


def assert_two_real_steps(logged: list[dict]) -> None:
    steps = [entry for entry in logged if "train" in entry]
    assert len(steps) == 2 and any("val" in entry for entry in logged)
    assert steps[0]["train"]["loss"] != steps[1]["train"]["loss"]
    assert all(step["train"]["loss"] > 0 for step in steps)


def test_two_speculators_training_steps_give_the_same_losses_online_offline_and_on_vllm_files(
    files, bf16_model_dir, bf16_server, tmp_path, cpu_shims, monkeypatch
):
    def argv(name: str, *source: str) -> list[str]:
        return train_argv("eagle3", bf16_model_dir, files["prepared"], tmp_path / name, *source)

    reference = train(
        argv("reference", "--num-workers", "0", "--hidden-states-path", str(files["reference"])), monkeypatch
    )
    served = train(
        argv("served", "--num-workers", "0", "--hidden-states-path", str(files["served"])), monkeypatch
    )
    online_source = [
        "--num-workers",
        "1",
        "--hidden-states-backend",
        "eagle3-target",
        "--eagle3-target",
        bf16_server.url,
    ]
    online = train(argv("online", *online_source), monkeypatch)
    assert_two_real_steps(reference)
    assert served == reference
    assert online == reference


@pytest.fixture(scope="module")
def fp32_targets(files, tmp_path_factory) -> Iterator[dict[str, dict[str, Any]]]:
    """Per verifier, started on first use: an fp32 tiny model served by us (capturing CAPTURE_LAYER_IDS),
    and the files speculators' own data generation writes for the rows from vLLM's CPU build, capturing
    `datagen_ids` (vLLM ids); the engine stops once they are written. "llama" feeds every method but MTP
    (its datagen captures all their layers, 2..8); "qwen3-mtp", a Qwen3 with a native MTP head, feeds MTP
    (only L). fp32: vLLM's kernels and transformers' agree to about 1e-5 there (bf16: to its rounding)."""
    servers: list[ServerProcess] = []

    class Lazy(dict):
        def __missing__(self, name: str) -> dict[str, Any]:
            root = tmp_path_factory.mktemp(name)
            model_dir = vllm_model_dir = write_tiny_model(
                root / "model", arch="llama" if name == "llama" else "qwen3", dtype="float32"
            )
            if name != "llama":
                model_dir = add_mtp_head(vllm_model_dir, root / "model-mtp")
            datagen_ids = DATAGEN_CAPTURE_IDS if name == "llama" else [NUM_LAYERS]
            with vllm_server(vllm_model_dir, datagen_ids, root, MAX_MODEL_LEN) as endpoint:
                datagen = generate_offline_data(endpoint, vllm_model_dir, files["prepared"], root / "datagen")
            server = start_server(
                root,
                [
                    "--model", str(model_dir), "--engine", "hf", "--dtype", "float32",
                    "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-tokens", str(MAX_BATCH_TOKENS),
                    "--capture-layer-ids", ",".join(map(str, CAPTURE_LAYER_IDS)),
                ],
            )  # fmt: skip
            servers.append(server)
            self[name] = {
                "model": model_dir,
                "datagen": datagen,
                "datagen_ids": datagen_ids,
                "url": server.url,
            }
            return self[name]

    yield Lazy()
    for server in servers:
        server.stop()


@pytest.mark.parametrize("speculator_type", ["eagle3", "peagle", "dflash", "dspark", "mtp"])
def test_each_draft_method_trains_online_as_on_speculators_own_vllm_files(
    speculator_type,
    fp32_targets,
    files,
    tmp_path,
    cpu_shims,
    monkeypatch,
    cluster,
    namespace,
    objects,
    record_property,
):
    """Two steps online against our server, by URL and by name, give the losses of two steps on the files
    speculators' `generate-offline-data` wrote from vLLM, to vLLM's fp32 agreement with transformers; the
    features themselves agree with vLLM's row by row."""
    target = fp32_targets["qwen3-mtp" if speculator_type == "mtp" else "llama"]
    datagen = select_capture_ids(
        target["datagen"], target["datagen_ids"], method_capture_ids(speculator_type), tmp_path / "datagen"
    )
    transfer = backend.Eagle3TargetBackend.from_train_args(
        plugin_args(target["url"], speculator_type=speculator_type, target_layer_ids=vllm_capture_ids(
            method(speculator_type).default_layer_ids(NUM_LAYERS)
        )),
        str(files["prepared"]),
    )  # fmt: skip
    for path in sorted(datagen.glob("hs_*.safetensors")):
        want = load_file(path)
        got = transfer.get_cached(int(path.stem.removeprefix("hs_")))
        assert torch.equal(got["token_ids"], want["token_ids"])
        torch.testing.assert_close(got["hidden_states"], want["hidden_states"], atol=1e-4, rtol=1e-4)
    publish(objects, namespace, f"tiny-{speculator_type}", target["url"])

    def argv(name: str, *source: str) -> list[str]:
        return train_argv(speculator_type, target["model"], files["prepared"], tmp_path / name, *source)

    reference = train(
        argv("datagen", "--num-workers", "0", "--hidden-states-path", str(datagen)), monkeypatch
    )
    online = train(
        argv("online", "--num-workers", "0", "--hidden-states-backend", "eagle3-target",
             "--eagle3-target", target["url"]),
        monkeypatch,
    )  # fmt: skip
    by_name = train(
        argv("by-name", "--num-workers", "0", "--hidden-states-backend", "eagle3-target",
             "--eagle3-target", f"tiny-{speculator_type}", "--eagle3-target-namespace", namespace,
             "--eagle3-target-kubeconfig", str(cluster.kubeconfig)),
        monkeypatch,
    )  # fmt: skip
    assert by_name == online
    assert_two_real_steps(reference)
    assert [sorted(entry) for entry in online] == [sorted(entry) for entry in reference]
    for got, want in zip(online, reference, strict=True):
        for phase in ("train", "val"):
            losses = {name: value for name, value in want.get(phase, {}).items() if "loss" in name}
            for name, value in losses.items():
                record_property(f"{phase}.{name}", {"online": got[phase][name], "vllm_files": value})
                assert got[phase][name] == pytest.approx(value, rel=LOSS_RTOL), (phase, name)
            assert phase not in want or losses


def test_a_draft_trains_on_a_target_found_by_name(
    cluster, namespace, objects, files, rows, plain_model, bf16_model_dir, bf16_server, tmp_path, cpu_shims,
    monkeypatch,
):  # fmt: skip
    """`--eagle3-target NAME --eagle3-target-namespace NS`, resolved through the API server in the trainer
    and again in its DataLoader worker (the test plays the operator and publishes the server in status)."""
    publish(objects, namespace, "tiny-llama", bf16_server.url)
    reference_files = write_vllm_files(
        plain_model, rows, method_capture_ids("dflash"), tmp_path / "reference"
    )

    def argv(name: str, *source: str) -> list[str]:
        return train_argv("dflash", bf16_model_dir, files["prepared"], tmp_path / name, *source)

    reference = train(
        argv("reference", "--num-workers", "0", "--hidden-states-path", str(reference_files)), monkeypatch
    )
    by_name = train(
        argv("by-name", "--num-workers", "1", "--hidden-states-backend", "eagle3-target",
             "--eagle3-target", "tiny-llama", "--eagle3-target-namespace", namespace,
             "--eagle3-target-kubeconfig", str(cluster.kubeconfig)),
        monkeypatch,
    )  # fmt: skip
    assert_two_real_steps(reference)
    assert by_name == reference
