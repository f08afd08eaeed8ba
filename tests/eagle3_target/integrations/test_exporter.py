"""`eagle3-target export speculators|specforge` against a real server on loopback: the files equal what vLLM
and SGLang would have captured, and the exporter behaves like a tool (resume, atomic writes, guards,
fail-over). No trainer needs to be installed for any of this."""

from __future__ import annotations

import json
import os

import pytest
import torch
from eagle3_target.cli import app
from eagle3_target.client.target_client import TargetClient
from eagle3_target.integrations import exporter
from eagle3_target.integrations.exporter import ExportError, export, pack
from eagle3_target.integrations.layouts import (
    LayoutMismatch,
    SpecForgeLayout,
    SpeculatorsLayout,
    specforge_aux_layer_ids,
    speculators_sample,
)
from eagle3_target.integrations.rows import JsonlRows, Row, RowError
from eagle3_target.methods import vllm_capture_ids
from eagle3_target.runners.hf import HFRunner
from safetensors.torch import load_file
from typer.testing import CliRunner

from support.cluster.waiting import free_port
from support.targets import create_target, target_status, write_status
from support.trainer_rows import MAX_MODEL_LEN, sglang_record, vllm_file

ONE_ROW = ["--batch-tokens", "48"]  # the longest row: every request holds one row, unpadded, as vLLM runs it


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(app, ["export", *args, "--quiet"])
    assert result.exit_code == 0, result.output
    return result.output


def fail_cli(*args: str) -> str:
    result = CliRunner().invoke(app, ["export", *args, "--quiet"])
    assert result.exit_code == 1, result.output
    return result.output


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{name} differs by {(got[name] - tensor).abs().max()}"


def test_speculators_files_equal_what_vllm_would_capture(
    bf16_server, rows_jsonl, rows, plain_model, tmp_path
):
    out = tmp_path / "out"
    summary = run_cli(
        "speculators", "--url", bf16_server.url, "--data", str(rows_jsonl), "--out", str(out), *ONE_ROW
    )
    assert f"exported {len(rows)} rows" in summary
    capture_ids = vllm_capture_ids([1, 3, 4])
    assert capture_ids == [2, 4, 5]
    for i, row in enumerate(rows):
        got = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert_same(got, vllm_file(plain_model, row["input_ids"], [*capture_ids, 8]))
    manifest = json.loads((out / exporter.MANIFEST).read_text())
    # The EAGLE-3 files come from the format they always came from (an export made before resumes).
    assert manifest["layout"] == "speculators" and manifest["format"] == "hidden_prenorm"
    assert (
        manifest["target"]["aux_layer_ids"] == [1, 3, 4] and manifest["target"]["model"] == "tiny-llama-bf16"
    )


def test_speculators_files_for_any_layers_and_for_a_method(
    bf16_server, rows_jsonl, rows, plain_model, tmp_path
):
    """`--layers` (our ids) and `--method`: the layers + 1 as vLLM capture ids, then L (MTP: only L)."""
    for flags, capture_ids in (
        (["--layers", "5,2", "--final", "prenorm"], [3, 6, 8]),
        (["--layers", "7,2"], [3, 8]),  # L-1 is h_L: vLLM's id L, in the file once, last
        (["--method", "dspark"], [2, 3, 5, 7, 8]),
        (["--method", "mtp"], [8]),
    ):
        out = tmp_path / "-".join(flags)
        run_cli(
            "speculators",
            "--url",
            bf16_server.url,
            "--data",
            str(rows_jsonl),
            "--out",
            str(out),
            *flags,
            *ONE_ROW,
        )
        for i, row in enumerate(rows):
            got = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
            assert_same(got, vllm_file(plain_model, row["input_ids"], capture_ids))


def test_speculators_export_of_layers_the_target_lacks_writes_nothing(bf16_server, rows_jsonl, tmp_path):
    out = tmp_path / "out"
    url = ["--url", bf16_server.url, "--data", str(rows_jsonl), "--out", str(out)]
    output = fail_cli("speculators", *url, "--layers", "0,2")
    assert "lacks [0]" in output and "captures [1, 2, 3, 4, 5, 6]" in output
    assert not out.exists()
    for flags, message in (
        (["--layers", "2", "--final", "postnorm"], "must be prenorm"),
        (["--method", "dflash", "--layers", "2"], "not both"),
        (["--final", "prenorm"], "--final needs --layers"),
        (["--method", "eagle9"], "unknown draft method"),
    ):
        assert message in fail_cli("speculators", *url, *flags)
        assert not out.exists()
    # An earlier export in the directory is left as it was.
    run_cli("speculators", *url, *ONE_ROW)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert len(before) > 1
    assert "lacks [0]" in fail_cli("speculators", *url, "--layers", "0,2")
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_specforge_files_equal_what_sglang_would_capture(
    bf16_server, rows_jsonl, rows, plain_model, tmp_path
):
    out = tmp_path / "out"
    run_cli("specforge", "--url", bf16_server.url, "--data", str(rows_jsonl), "--out", str(out), *ONE_ROW)
    for i, row in enumerate(rows):
        got = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert_same(got, sglang_record(plain_model, row, [1, 3, 4]))
        # Only the row's own bytes are stored, not the storage of the request it came in.
        assert got["hidden_state"].untyped_storage().nbytes() == got["hidden_state"].nbytes


def test_packed_requests_give_each_row_its_own_slice_of_the_batch(
    bf16_server, bf16_model_dir, rows_jsonl, tmp_path
):
    with TargetClient(bf16_server.url) as client:
        summary = export(
            client, JsonlRows(rows_jsonl), SpeculatorsLayout(), tmp_path, depth=1, progress=False
        )
    assert summary.rows_written == 12 and summary.requests < 12  # rows shared requests
    runner = HFRunner.from_pretrained(bf16_model_dir, dtype="bfloat16", device="cpu")
    everything = [True] * 12
    for batch in pack(JsonlRows(rows_jsonl).rows(everything), 256):
        ids, mask = exporter.padded(batch)
        prenorm, aux = runner.forward_hidden(ids, mask, prenorm=True)
        for i, row in enumerate(batch):
            n = row.input_ids.numel()
            want = speculators_sample(aux[i, :n], prenorm[i, :n], row.input_ids, [1, 3, 4])
            assert_same(load_file(tmp_path / "hidden_states" / f"hs_{row.index}.safetensors"), want)


def test_pack_fills_requests_up_to_the_limit_longest_rows_first():
    lengths = [5, 9, 3, 9, 2, 7]
    rows = [
        Row(i, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
        for i, n in enumerate(lengths)
    ]
    batches = [[r.index for r in batch] for batch in pack(iter(rows), 20)]
    assert batches == [[1, 3], [5, 0], [2, 4]]  # 2x9, 2x7, 2x3 padded tokens: each within 20
    assert sorted(i for b in batches for i in b) == list(range(6))


def test_a_rerun_writes_only_the_missing_files_and_sweeps_partial_ones(bf16_server, rows_jsonl, tmp_path):
    args = ("speculators", "--url", bf16_server.url, "--data", str(rows_jsonl), "--out", str(tmp_path))
    run_cli(*args)
    files = sorted((tmp_path / "hidden_states").iterdir())
    assert len(files) == 12
    kept = {f: f.stat().st_mtime_ns for f in files[2:]}
    for f in files[:2]:
        f.unlink()
    stale = tmp_path / "hidden_states" / "hs_0.safetensors.abc123.partial"
    stale.write_bytes(b"half a file")
    summary = run_cli(*args)
    assert "exported 2 rows" in summary and "10 of 12 rows were already there" in summary
    assert all(f.stat().st_mtime_ns == mtime for f, mtime in kept.items())
    assert not stale.exists() and all(f.exists() for f in files)


def test_a_failed_write_leaves_neither_the_file_nor_a_partial_one(
    bf16_server, rows_jsonl, tmp_path, monkeypatch
):
    def broken_write(self, row, supervision, info, file):
        file.write(b"some bytes")
        raise OSError("disk full")

    monkeypatch.setattr(SpeculatorsLayout, "write", broken_write)
    with TargetClient(bf16_server.url) as client, pytest.raises(OSError, match="disk full"):
        export(client, JsonlRows(rows_jsonl), SpeculatorsLayout(), tmp_path, progress=False)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and p.parent.name == "hidden_states"]
    assert leftovers == []


def test_a_directory_of_another_targets_files_is_refused(bf16_server, rows_jsonl, tmp_path):
    run_cli("speculators", "--url", bf16_server.url, "--data", str(rows_jsonl), "--out", str(tmp_path))
    manifest = tmp_path / exporter.MANIFEST
    pinned = json.loads(manifest.read_text())
    pinned["target"]["fingerprint"] = "some-other-model"
    manifest.write_text(json.dumps(pinned))
    (tmp_path / "hidden_states" / "hs_0.safetensors").unlink()
    output = fail_cli(
        "speculators", "--url", bf16_server.url, "--data", str(rows_jsonl), "--out", str(tmp_path)
    )
    assert "another target" in output and "new --out" in output
    assert not (tmp_path / "hidden_states" / "hs_0.safetensors").exists()


def test_a_row_longer_than_the_server_takes_fails_before_any_request(bf16_server, rows, tmp_path):
    data = tmp_path / "rows.jsonl"
    long_row = {"input_ids": [1] * (MAX_MODEL_LEN + 1), "loss_mask": [1] * (MAX_MODEL_LEN + 1)}
    data.write_text("".join(json.dumps(r) + "\n" for r in [*rows[:3], long_row]))
    output = fail_cli(
        "specforge", "--url", bf16_server.url, "--data", str(data), "--out", str(tmp_path / "out")
    )
    assert f"row 3 ({MAX_MODEL_LEN + 1} tokens)" in output and f"max_model_len {MAX_MODEL_LEN}" in output
    assert not list((tmp_path / "out").rglob("*.ckpt"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ('{"input_ids": [1, 2]}', "'input_ids' and 'loss_mask'"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "loss_mask has 1 entries, input_ids 2"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', "only 0 and 1"),
        ('{"input_ids": [], "loss_mask": []}', "empty"),
        ('{"input_ids": [1.5, 2], "loss_mask": [1, 1]}', "integers"),
    ],
)
def test_malformed_rows_are_refused_with_their_line(tmp_path, line, message):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n\n' + line + "\n")
    with pytest.raises(RowError, match=message) as raised:
        JsonlRows(data).scan()
    assert f"{data}:3" in str(raised.value)


def test_requests_fail_over_to_the_endpoint_that_answers(bf16_server, rows_jsonl, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    summary = run_cli(
        "specforge",
        "--url",
        dead,
        "--url",
        bf16_server.url,
        "--data",
        str(rows_jsonl),
        "--out",
        str(tmp_path),
    )
    assert "exported 12 rows" in summary
    retried = int(summary.split(" requests, ")[1].split(" retried")[0])
    assert retried >= 1


def test_one_exporter_per_directory(bf16_server, rows_jsonl, tmp_path):
    with (
        exporter.exclusive(tmp_path),
        TargetClient(bf16_server.url) as client,
        pytest.raises(ExportError, match="another export"),
    ):
        export(client, JsonlRows(rows_jsonl), SpeculatorsLayout(), tmp_path, progress=False)


def test_specforge_refuses_a_target_it_would_misread(bf16_server, rows_jsonl, tmp_path):
    output = fail_cli(
        "specforge",
        "--url",
        bf16_server.url,
        "--data",
        str(rows_jsonl),
        "--out",
        str(tmp_path),
        "--aux-layer-ids",
        "0",
        "2",
        "5",
    )
    assert "aux layers [0, 2, 5]" in output and "captures [1, 3, 4]" in output
    with TargetClient(bf16_server.url) as client:
        served = client.info()
    with pytest.raises(LayoutMismatch, match="--dtype bfloat16"):
        SpecForgeLayout().check(served.model_copy(update={"dtype": "float32"}))


def test_specforge_aux_layer_ids_follow_specforges_own_precedence(tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}))
    assert specforge_aux_layer_ids(32) == [1, 15, 28]
    assert specforge_aux_layer_ids(32, draft_config=draft) == [0, 2, 5]
    assert specforge_aux_layer_ids(32, [3, 4, 6], draft_config=draft) == [3, 4, 6]


def test_speculators_sample_puts_the_aux_layers_in_ascending_capture_order():
    seq, hidden = 5, 4
    layers = [torch.full((seq, hidden), float(v)) for v in (40, 10, 30)]  # captured for aux ids [4, 1, 3]
    prenorm = torch.full((seq, hidden), 99.0)
    sample = speculators_sample(torch.cat(layers, dim=-1), prenorm, torch.arange(seq), [4, 1, 3])
    assert sample["hidden_states"].shape == (seq, 4, hidden)
    assert sample["hidden_states"][0, :, 0].tolist() == [10, 30, 40, 99]
    assert sample["token_ids"].dtype == torch.int64
    assert vllm_capture_ids([4, 1, 3]) == [2, 4, 5]


def test_target_and_url_are_exclusive(rows_jsonl, tmp_path):
    output = fail_cli(
        "speculators",
        "--target",
        "t",
        "--url",
        "http://x:1",
        "--data",
        str(rows_jsonl),
        "--out",
        str(tmp_path),
    )
    assert "not both" in output
    output = fail_cli("speculators", "--data", str(rows_jsonl), "--out", str(tmp_path))
    assert "--target" in output
    assert not os.listdir(tmp_path)


def test_export_by_resource_name_follows_the_targets_status(
    cluster, namespace, objects, bf16_server, rows_jsonl, tmp_path
):
    """The user's command: `--target NAME -n NS`, resolved through the API server (the test plays the
    operator and publishes the server's endpoint in status)."""
    with TargetClient(bf16_server.url) as client:
        fingerprint = client.info().fingerprint
    published = target_status(1, "True", "AllReplicasReady")
    published["model"] = published["model"] | {"fingerprint": fingerprint}
    published["endpoints"] = [
        {"pod": "llama31-8b-0", "address": bf16_server.url, "ready": True, "node": "n0"}
    ]
    create_target(objects, namespace, "llama31-8b")
    write_status(objects, namespace, "llama31-8b", published)
    summary = run_cli(
        "specforge", "--target", "llama31-8b", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig),
        "--data", str(rows_jsonl), "--out", str(tmp_path), "--wait", "30",
    )  # fmt: skip
    assert "exported 12 rows" in summary
    assert len(list(tmp_path.rglob("*.ckpt"))) == 12
    output = fail_cli(
        "specforge",
        "--target",
        "absent",
        "-n",
        namespace,
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--data",
        str(rows_jsonl),
        "--out",
        str(tmp_path / "x"),
        "--wait",
        "0",
    )
    assert "absent" in output
