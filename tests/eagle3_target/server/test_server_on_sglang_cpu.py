"""`eagle3-target serve --engine sglang` on real SGLang 0.5.23 (run by `make test` with .venv-sglang's
python, whose `eagle3-target` this launches): every format and the trainer's batch through `TargetClient`
equal the HF engine's within 1e-4 in fp32; an engine argument SGLang lacks ends the server at once; a
tensor-parallel rank that died turns the server unready and ends it.

One SGLang server serves the module; the HF side is the session's shared HF server on the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from eagle3_target.client import TargetClient
from eagle3_target.protocol import EXIT_ENGINE_FAILED, EXIT_LOAD_FAILED, FORMATS, SERVED_FORMATS
from eagle3_target.tiny import write_tiny_model

from support.cluster.waiting import eventually, free_port
from support.engine_servers import assert_layers_match, info
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

ATOL = 1e-4
SGLANG_START_SECONDS = 300  # about 15 s here (imports, then loading), with room for a loaded machine


@pytest.fixture(scope="module")
def sglang_server(
    server: ServerProcess, server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("sglang-server")
    args = [
        "--model", str(server_model_dir),
        "--engine", "sglang",
        "--dtype", "float32",
        "--max-batch-tokens", str(MAX_BATCH_TOKENS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--model-name", "tiny-llama",
        "--revision", "r1",
        "--capture-layer-ids", ",".join(map(str, info(server)["capture_layer_ids"])),
        "--engine-arg=max_running_requests=8",
    ]  # fmt: skip
    proc = start_server(directory, args, ready_timeout=SGLANG_START_SECONDS)
    yield proc
    proc.stop()


def test_info_names_the_engine_and_matches_the_hf_server(sglang_server, server):
    ours, theirs = (httpx.get(s.url + "/v1/info").json() for s in (sglang_server, server))
    assert ours["engine"] == "sglang" and theirs["engine"] == "hf"
    same = ("model", "revision", "dtype", "num_hidden_layers", "hidden_size", "vocab_size")
    same += ("aux_layer_ids", "capture_layer_ids")
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert ours["formats"] == list(SERVED_FORMATS) and ours["max_model_len"] == MAX_MODEL_LEN


def test_every_format_equals_the_hf_engine(sglang_server, server):
    ids, mask, _ = token_batch(seed=5, batch=3, seq=40, pad_last=13)
    mapping = draft_mapping(64, seed=9)
    with httpx.Client(timeout=120) as client:
        for url in (sglang_server.url, server.url):
            assert put_mapping(client, url, "m1", mapping).status_code in (200, 201)
        for fmt, spec in FORMATS.items():
            params = {"format": fmt} | ({"vocab": "m1"} if spec.needs_vocab else {})
            got, _ = supervise(
                client, sglang_server.url, {"input_ids": ids, "attention_mask": mask}, **params
            )
            want, _ = supervise(client, server.url, {"input_ids": ids, "attention_mask": mask}, **params)
            assert sorted(got) == sorted(want) == sorted(spec.tensors), fmt
            assert_close_at_real_positions(got, want, mask, ATOL, fmt)


def test_the_layers_format_equals_the_hf_engine_for_five_layers_with_the_last(sglang_server, server):
    assert_layers_match(sglang_server, server, ATOL)


@pytest.mark.parametrize("fmt", ["hidden", "logits", "probs"])
def test_the_trainers_batch_through_target_client_equals_the_hf_engine(sglang_server, server, fmt):
    ids, mask, loss_mask = token_batch(seed=6, batch=2, seq=33)  # unpadded: HF computes padding positions too
    mapping = draft_mapping(48, seed=2) if FORMATS[fmt].needs_vocab else None
    with TargetClient([sglang_server.url]) as ours, TargetClient([server.url]) as theirs:
        got = ours.batch(ids, mask, loss_mask, format=fmt, mapping=mapping)
        want = theirs.batch(ids, mask, loss_mask, format=fmt, mapping=mapping)
    assert_same_batch(got, want, ATOL)


def test_an_unknown_engine_argument_ends_the_server_before_loading(server_model_dir, tmp_path):
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    args = [
        "--model", str(server_model_dir),
        "--engine", "sglang",
        "--termination-log", str(termination_log),
        "--engine-arg", "mem_fraction_statc=0.5",
    ]  # fmt: skip
    server = launch(tmp_path / "server.log", free_port(), args)
    try:
        code = server.process.wait(timeout=SGLANG_START_SECONDS)
    finally:
        server.stop()
    assert code == EXIT_LOAD_FAILED, server.log()[-3000:]
    assert "did you mean mem_fraction_static?" in termination_log.read_text(), termination_log.read_text()


def test_a_tensor_parallel_server_whose_rank_died_turns_unready_and_exits_to_be_restarted(tmp_path):
    """A rank process that died (killed here, as the OOM killer or a driver fault would) leaves the ranks
    unable to run a forward; the server says so on /readyz, writes why and exits so the pod is restarted."""
    model = write_tiny_model(tmp_path / "model", arch="llama", num_kv_heads=2)  # a KV head per rank
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    args = [
        "--model", str(model),
        "--engine", "sglang",
        "--dtype", "float32",
        "--tensor-parallel-size", "2",
        "--max-batch-tokens", "1024",
        "--max-model-len", "128",
        "--termination-log", str(termination_log),
    ]  # fmt: skip
    server = start_server(tmp_path, args, ready_timeout=SGLANG_START_SECONDS)
    try:
        ranks = [
            child
            for child in psutil.Process(server.process.pid).children()
            if "resource_tracker" not in " ".join(child.cmdline())
        ]
        assert len(ranks) == 2
        ranks[1].kill()
        unready = eventually(lambda: status_code(server.url + "/readyz") == 503, "/readyz to say 503")
        code = server.process.wait(timeout=SGLANG_START_SECONDS)
    finally:
        server.stop()
    assert unready and code == EXIT_ENGINE_FAILED, server.log()[-3000:]
    said = termination_log.read_text()
    assert said.startswith("the engine failed: SGLang tensor-parallel rank") and "exited" in said, said
