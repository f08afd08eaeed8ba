"""`eagle3-target serve --engine vllm` on real vLLM (its CPU build): every format, the trainer's batch
through `TargetClient` and NeMo's `/generate` equal the HF engine's within 1e-4 in fp32; the fail-fast
exits; nothing left in the capture directory once the server has stopped.

One vLLM server serves the module (its start is most of the cost: about a minute here); the HF side is the
session's shared HF server and in-process runner on the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from eagle3_target.client import TargetClient
from eagle3_target.protocol import EXIT_ENGINE_FAILED, EXIT_LOAD_FAILED, FORMATS, SERVED_FORMATS
from eagle3_target.runners import TargetRunner

from support.cluster.waiting import eventually, free_port
from support.engine_servers import assert_layers_match, info
from support.nemo_client import (
    assert_generate_matches,
    generate,
    loss_mask_for,
    nemo_reference,
    nemo_session,
    set_mapping,
)
from support.server_process import (
    MAX_BATCH_TOKENS,
    MAX_MODEL_LEN,
    ServerProcess,
    launch,
    start_server,
    status_code,
)
from support.supervision import (
    assert_close_at_real_positions,
    assert_same_batch,
    draft_mapping,
    put_mapping,
    supervise,
    token_batch,
)
from support.vllm_runner import CPU_ENGINE_ARGS

ATOL = 1e-4
VLLM_START_SECONDS = 300  # the engine's start on a loaded two-core machine, with room
ENGINE_ARGS = [f"--engine-arg={key}={value}" for key, value in CPU_ENGINE_ARGS.items()]


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-captures")


@pytest.fixture(scope="module")
def vllm_server(
    server: ServerProcess, server_model_dir: Path, capture_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("vllm-server")
    args = [
        "--model", str(server_model_dir),
        "--engine", "vllm",
        "--dtype", "float32",
        "--max-batch-tokens", str(MAX_BATCH_TOKENS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--model-name", "tiny-llama",
        "--revision", "r1",
        "--capture-layer-ids", ",".join(map(str, info(server)["capture_layer_ids"])),
        f"--engine-arg=hidden_states_dir={capture_dir}",
        *ENGINE_ARGS,
    ]  # fmt: skip
    proc = start_server(directory, args, ready_timeout=VLLM_START_SECONDS)
    yield proc
    proc.stop()


def test_info_names_the_engine_and_matches_the_hf_server(vllm_server, server):
    ours, theirs = (httpx.get(s.url + "/v1/info").json() for s in (vllm_server, server))
    assert ours["engine"] == "vllm" and theirs["engine"] == "hf"
    same = ("model", "revision", "dtype", "num_hidden_layers", "hidden_size", "vocab_size")
    same += ("aux_layer_ids", "capture_layer_ids")
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert ours["formats"] == list(SERVED_FORMATS)
    # vLLM needs one slot of its max_model_len for the token it generates, so rows are one shorter.
    assert ours["max_model_len"] == MAX_MODEL_LEN - 1 and theirs["max_model_len"] == MAX_MODEL_LEN


def test_every_format_equals_the_hf_engine(vllm_server, server):
    ids, mask, _ = token_batch(seed=5, batch=3, seq=40, pad_last=13)
    mapping = draft_mapping(64, seed=9)
    with httpx.Client(timeout=120) as client:
        for url in (vllm_server.url, server.url):
            assert put_mapping(client, url, "m1", mapping).status_code in (200, 201)
        for fmt, spec in FORMATS.items():
            params = {"format": fmt} | ({"vocab": "m1"} if spec.needs_vocab else {})
            got, _ = supervise(client, vllm_server.url, {"input_ids": ids, "attention_mask": mask}, **params)
            want, _ = supervise(client, server.url, {"input_ids": ids, "attention_mask": mask}, **params)
            assert sorted(got) == sorted(want) == sorted(spec.tensors), fmt
            assert_close_at_real_positions(got, want, mask, ATOL, fmt)


def test_the_layers_format_equals_the_hf_engine_for_five_layers_with_the_last(vllm_server, server):
    assert_layers_match(vllm_server, server, ATOL)


@pytest.mark.parametrize("fmt", ["hidden", "logits", "probs"])
def test_the_trainers_batch_through_target_client_equals_the_hf_engine(vllm_server, server, fmt):
    ids, mask, loss_mask = token_batch(seed=6, batch=2, seq=33)  # unpadded: see the test above
    mapping = draft_mapping(48, seed=2) if FORMATS[fmt].needs_vocab else None
    with TargetClient([vllm_server.url]) as ours, TargetClient([server.url]) as theirs:
        got = ours.batch(ids, mask, loss_mask, format=fmt, mapping=mapping)
        want = theirs.batch(ids, mask, loss_mask, format=fmt, mapping=mapping)
    assert_same_batch(got, want, ATOL)


def test_nemo_generate_equals_the_co_located_batch(vllm_server, reference_runner: TargetRunner):
    mapping = draft_mapping(64, seed=31)
    ids, mask, _ = token_batch(32, 2, 20)  # unpadded: the HF engine computes padding positions too
    loss_mask = loss_mask_for(mask)
    with nemo_session() as session:
        assert set_mapping(session, vllm_server.url, mapping).json()["status"] == "ok"
        response = generate(session, vllm_server.url, ids, mask, loss_mask)
    want = nemo_reference(reference_runner, ids, mask, loss_mask, mapping)
    assert_generate_matches(response, want, atol=ATOL)


def test_a_stopped_server_leaves_no_capture_file(vllm_server, capture_dir):
    ids, mask, _ = token_batch(seed=1, batch=2, seq=16)
    with httpx.Client(timeout=60) as client:
        supervise(client, vllm_server.url, {"input_ids": ids, "attention_mask": mask})
    vllm_server.stop()
    # A graceful stop (uvicorn ends with the SIGTERM it was sent once its shutdown is complete).
    assert "Application shutdown complete" in vllm_server.log(), vllm_server.log()[-3000:]
    assert [p for p in capture_dir.rglob("*")] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Passes the runner's checks; vLLM itself refuses it when it builds its configs.
        (["--engine-arg", "quantization=no-such-method"], "model load failed: "),
        (["--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
    ],
)
def test_a_refusal_ends_the_vllm_server(server_model_dir, tmp_path, args, message):
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    base = ["--model", str(server_model_dir), "--engine", "vllm", "--termination-log", str(termination_log)]
    server = launch(tmp_path / "server.log", free_port(), [*base, *ENGINE_ARGS, *args])
    try:
        code = server.process.wait(timeout=VLLM_START_SECONDS)
    finally:
        server.stop()
    assert code == EXIT_LOAD_FAILED, server.log()[-3000:]
    assert termination_log.read_text().startswith(message), termination_log.read_text()


def test_a_server_whose_engine_core_died_turns_unready_and_exits_to_be_restarted(server_model_dir, tmp_path):
    """vLLM never restarts an engine core that exited (a worker died, a batch raised in it): a server that
    answered 500 forever while Kubernetes saw it ready would strand every trainer on it."""
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    args = ["--model", str(server_model_dir), "--engine", "vllm", "--termination-log", str(termination_log)]
    server = start_server(tmp_path, [*args, *ENGINE_ARGS], ready_timeout=VLLM_START_SECONDS)
    try:
        for child in psutil.Process(server.process.pid).children():
            if "resource_tracker" not in " ".join(child.cmdline()):
                child.kill()  # the engine core process
        unready = eventually(lambda: status_code(server.url + "/readyz") == 503, "/readyz to say 503")
        code = server.process.wait(timeout=VLLM_START_SECONDS)
    finally:
        server.stop()
    assert unready and code == EXIT_ENGINE_FAILED, server.log()[-3000:]
    assert termination_log.read_text().startswith("the engine failed: vLLM's engine core has exited")
