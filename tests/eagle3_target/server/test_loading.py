"""The server's start-up: refusals end the process at once with one line in the termination log, weights
still arriving are waited for, and /readyz says which phase the load is in and how far it got."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from eagle3_target.protocol import EXIT_INVALID_SETTINGS, EXIT_LOAD_FAILED, LoadPhase, LoadProgress
from eagle3_target.runners import load_runner
from eagle3_target.server.loading import (
    TERMINATION_MESSAGE_LIMIT,
    LoadFailed,
    LoadTracker,
    check_model_dir,
    failure_line,
    weight_loading_progress,
    weights_pending,
    write_termination_message,
)
from eagle3_target.server.target import CanaryError

from support.cluster.waiting import LOOPBACK, free_port
from support.server_process import launch

EXIT_SECONDS = 90  # a Python start, the imports and the refusal, on a busy shared CI machine


def copy_model(source: Path, directory: Path) -> Path:
    target = directory / "model"
    shutil.copytree(source, target)
    return target


def test_a_model_directory_that_is_missing_or_has_no_config_is_refused(tmp_path: Path):
    with pytest.raises(LoadFailed, match="does not exist; point --model at the directory"):
        check_model_dir(str(tmp_path / "absent"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(LoadFailed, match="is not a directory"):
        check_model_dir(str(tmp_path / "file"))
    with pytest.raises(LoadFailed, match=r"has no config\.json"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoadFailed, match="is not readable JSON"):
        check_model_dir(str(tmp_path))


def test_weights_pending_until_every_shard_is_complete(tiny_llama_dir: Path, tmp_path: Path):
    model = copy_model(tiny_llama_dir, tmp_path)
    assert weights_pending(model) is None
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) >= 2
    aside = tmp_path / "aside"
    shards[-1].rename(aside)
    assert weights_pending(model) == (
        f"{len(shards) - 1} of {len(shards)} weight files present (waiting for {shards[-1].name})"
    )
    # Copied in half-way: shorter than its header says.
    data = aside.read_bytes()
    shards[-1].write_bytes(data[: len(data) // 2])
    assert weights_pending(model) == (
        f"{shards[-1].name} is still being written ({len(data) // 2} of {len(data)} bytes)"
    )
    shards[-1].write_bytes(data[:5])
    assert weights_pending(model) == f"{shards[-1].name} is still being written (5 bytes)"
    shards[-1].write_bytes(data)
    assert weights_pending(model) is None
    index = model / "model.safetensors.index.json"
    index.write_text(index.read_text()[:20])
    assert weights_pending(model) == "model.safetensors.index.json is still being written"


def test_weights_pending_for_a_single_file_model(tiny_qwen3_dir: Path, tmp_path: Path):
    model = copy_model(tiny_qwen3_dir, tmp_path)
    assert weights_pending(model) is None
    (model / "model.safetensors").unlink()
    assert weights_pending(model).startswith("no weights yet (no model.safetensors or pytorch_model.bin")


def test_failure_lines_are_one_line_within_the_kubelet_limit():
    assert failure_line(LoadFailed("a\nb;  c")) == "a b; c"
    assert failure_line(RuntimeError("boom")) == (
        "model load failed: RuntimeError: boom; the server log has the traceback"
    )
    assert failure_line(CanaryError("canary aux layer 3 is all zeros")).startswith(
        "the start-up canary failed: canary aux layer 3 is all zeros; "
    )
    long = failure_line(LoadFailed("é" * 5000))
    assert len(long.encode()) <= TERMINATION_MESSAGE_LIMIT and "\n" not in long


def test_the_termination_message_goes_only_to_a_file_kubernetes_made(tmp_path: Path):
    absent = tmp_path / "termination-log"
    write_termination_message(absent, "why")
    assert not absent.exists()
    absent.touch()
    write_termination_message(absent, "why")
    assert absent.read_text() == "why\n"


def test_weight_loading_reports_transformers_count_of_tensors(tiny_llama_dir: Path):
    tracker = LoadTracker()
    seen: list[LoadProgress] = []
    update = tracker.update

    def record(*args: object) -> None:
        update(*args)  # type: ignore[arg-type]
        seen.append(tracker.snapshot())

    tracker.update = record  # type: ignore[method-assign]
    with weight_loading_progress(tracker, "loading weights"):
        load_runner("hf", tiny_llama_dir, dtype="float32", device="cpu")
    total = seen[-1].total
    assert total is not None and total > 10  # every layer's tensors, not one bar per file
    assert [p.done for p in seen] == list(range(total + 1))
    assert seen[-1].message == f"loading weights {total}/{total} tensors"
    assert {p.phase for p in seen} == {LoadPhase.LOADING}


def run_to_exit(tmp_path: Path, args: list[str]) -> tuple[int, str, str]:
    """Run `serve` until it exits by itself; returns (exit code, termination message, log)."""
    termination_log = tmp_path / "termination-log"
    termination_log.touch()  # as the kubelet does
    port = free_port()
    server = launch(tmp_path / "server.log", port, [*args, "--termination-log", str(termination_log)])
    try:
        code = server.process.wait(timeout=EXIT_SECONDS)
    finally:
        server.stop()
    return code, termination_log.read_text(), server.log()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["--engine", "vllm", "--engine-arg", "no_such_arg=2"],
            EXIT_LOAD_FAILED,
            "unknown engine argument no_such_arg; supported: ",
        ),
        (["--engine", "hf", "--max-queue", "0"], EXIT_INVALID_SETTINGS, "invalid setting: max_queue must be"),
    ],
)
def test_a_refused_argument_ends_the_server_before_it_listens(
    tiny_qwen3_dir: Path, tmp_path: Path, args: list[str], code: int, message: str
):
    exit_code, line, log = run_to_exit(tmp_path, ["--model", str(tiny_qwen3_dir), *args])
    assert exit_code == code, log
    assert line.startswith(message) and line.endswith("\n") and line.count("\n") == 1, line
    assert "Uvicorn running" not in log  # refused before the port was bound


def test_a_missing_model_directory_ends_the_server(tmp_path: Path):
    exit_code, line, log = run_to_exit(tmp_path, ["--model", str(tmp_path / "absent"), "--engine", "hf"])
    assert exit_code == EXIT_LOAD_FAILED, log
    assert line == (
        f"model directory {tmp_path / 'absent'} does not exist; point --model at the directory that holds "
        "config.json and the weights (check the volume)\n"
    )


def test_a_load_that_fails_after_listening_ends_the_server_too(tiny_qwen3_dir: Path, tmp_path: Path):
    model = copy_model(tiny_qwen3_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "no-such-architecture"}))
    exit_code, line, log = run_to_exit(tmp_path, ["--model", str(model), "--engine", "hf"])
    assert exit_code == EXIT_LOAD_FAILED, log
    assert line.startswith("model load failed: ValueError: "), line
    assert "no-such-architecture" in line
    assert "Uvicorn running" in log and "Traceback" in log


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--aux-layer-ids", "0", "1", "99"], "aux layer id 99 is out of range for a model with 8 layers"),
        (["--capture-layer-ids", "1,3,8"], "capture layer id 8 is out of range for a model with 8 layers"),
        (["--capture-layer-ids", "1,3,4,3"], "capture layer ids must be distinct, got [1, 3, 4, 3]"),
        (
            ["--capture-layer-ids", ",".join(map(str, range(33)))],
            "a capture set has 1 to 32 layer ids, got 33",
        ),
        (
            ["--capture-layer-ids", "1,3,5,7"],  # the default aux layers of 8 layers are [1, 3, 4]
            "the aux layers [1, 3, 4] must be captured, but the capture set [1, 3, 5, 7] lacks [4]",
        ),
    ],
)
def test_layer_ids_that_do_not_fit_the_model_end_the_server_before_it_loads(
    tiny_qwen3_dir: Path, tmp_path: Path, args: list[str], reason: str
):
    exit_code, line, log = run_to_exit(tmp_path, ["--model", str(tiny_qwen3_dir), "--engine", "hf", *args])
    assert exit_code == EXIT_LOAD_FAILED, log
    assert line.startswith(f"the layer ids do not fit this model: {reason}"), line
    assert line.rstrip().endswith(
        "fix --aux-layer-ids / --capture-layer-ids (spec.auxLayerIds / spec.captureLayerIds)"
    )
    assert "load: loading" not in log.lower() and "Traceback" not in log


def test_readyz_reports_weights_still_arriving_then_serves(tiny_llama_dir: Path, tmp_path: Path):
    model = copy_model(tiny_llama_dir, tmp_path)
    shards = sorted(model.glob("model-*.safetensors"))
    aside = tmp_path / "aside.safetensors"
    shards[0].rename(aside)
    port = free_port()
    server = launch(tmp_path / "server.log", port, ["--model", str(model), "--engine", "hf"])
    url = f"http://{LOOPBACK}:{port}"
    try:
        server.wait_until("/healthz", 200)
        deadline = time.monotonic() + EXIT_SECONDS
        while (body := httpx.get(url + "/readyz").json()).get("loading", {}).get("phase") == "starting":
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        progress = LoadProgress.model_validate(body["loading"])
        expected = f"waiting for weights: {len(shards) - 1} of {len(shards)} weight files present"
        assert progress.phase is LoadPhase.WAITING_FOR_WEIGHTS and progress.message.startswith(expected)
        assert body["error"] == {"type": "not_ready", "message": f"model is loading: {progress.message}"}
        info = httpx.get(url + "/v1/info")
        assert info.status_code == 503 and info.json()["loading"]["phase"] == "waiting_for_weights"
        shutil.copyfile(aside, shards[0])
        server.wait_until("/readyz", 200)
        assert "load: waiting for weights" in server.log()
    finally:
        server.stop()
