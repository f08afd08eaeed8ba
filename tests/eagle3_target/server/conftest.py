"""Server test fixtures: a tiny model, an in-process reference runner and real server processes.

Server processes are session-scoped (each costs a Python start and a model load), so the whole server
suite starts two: the main one and a restricted one (auth + queue of one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from eagle3_target.runners import TargetRunner, load_runner

from support.cluster.waiting import LOOPBACK, free_port
from support.server_process import AUTH_TOKEN, MAX_BATCH_TOKENS, MAX_MODEL_LEN, ServerProcess, start_server


@pytest.fixture(scope="session")
def server_model_dir(tiny_llama_dir: Path) -> Path:
    """The shared tiny Llama (8 layers, hidden 64, vocab 256, fp32, sharded)."""
    return tiny_llama_dir


@pytest.fixture(scope="session")
def reference_runner(server_model_dir: Path) -> TargetRunner:
    """The in-process runner the server's answers are compared with."""
    return load_runner("hf", server_model_dir, dtype="float32", device="cpu")


# The main server captures five layers in no sorted order: the last one (L-1, the pre-norm last state) and
# the default aux layers [1, 3, 4] among them, so every EAGLE-3 format is served from a capture set wider
# than its aux layers.
CAPTURE_LAYER_IDS = "7,1,3,0,4"


@pytest.fixture(scope="session")
def server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("server-logs"),
        [
            "--model", str(server_model_dir),
            "--engine", "hf",
            "--dtype", "float32",
            "--max-batch-tokens", str(MAX_BATCH_TOKENS),
            "--max-model-len", str(MAX_MODEL_LEN),
            "--model-name", "tiny-llama",
            "--revision", "r1",
            "--capture-layer-ids", CAPTURE_LAYER_IDS,
        ],
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def restricted_server(
    server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Configured through EAGLE3_TARGET_* env only: bearer auth, a queue of one, a separate metrics port."""
    directory = tmp_path_factory.mktemp("restricted")
    token_file = directory / "token"
    token_file.write_text(AUTH_TOKEN + "\n")
    env = {
        "EAGLE3_TARGET_MODEL": str(server_model_dir),
        "EAGLE3_TARGET_ENGINE": "hf",
        "EAGLE3_TARGET_DTYPE": "float32",
        "EAGLE3_TARGET_AUX_LAYER_IDS": "0 2 5",
        "EAGLE3_TARGET_MAX_QUEUE": "1",
        "EAGLE3_TARGET_MAX_BATCH_TOKENS": "65536",
        "EAGLE3_TARGET_AUTH_TOKEN_FILE": str(token_file),
        "EAGLE3_TARGET_METRICS_PORT": str(metrics_port := free_port()),
    }
    proc = start_server(directory, [], env=env, wait_ready=False)
    proc.metrics_url = f"http://{LOOPBACK}:{metrics_port}"
    proc.wait_until("/readyz", 200)
    yield proc
    proc.stop()
