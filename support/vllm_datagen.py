"""speculators' own data generation on vLLM's CPU build, the reference the trainer tests compare with: vLLM's
OpenAI server configured for hidden-states extraction the way speculators' launch script configures it
(`extract_hidden_states` with the capture ids, the file connector), and `speculators generate-offline-data`
run against it. Both in their own processes, as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from support.cluster.processes import terminate
from support.cluster.waiting import LOOPBACK, eventually, free_port
from support.server_process import status_code

# An engine start takes about 45 s on two cores (eager; compiling a tiny model tests nothing here).
START_TIMEOUT_S = 300.0
# Generating a few tiny rows takes seconds; a stuck request must not hold CI until its global limit.
DATAGEN_TIMEOUT_S = 600.0


@contextmanager
def vllm_server(model_dir: Path, capture_ids: list[int], work: Path, max_model_len: int) -> Iterator[str]:
    """vLLM's OpenAI server capturing `capture_ids` (vLLM capture ids) into `work`; yields its /v1 URL."""
    port = free_port()
    storage = work / "vllm-hidden-states"
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_ids}},
    }
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", LOOPBACK, "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--skip-tokenizer-init",
        "--kv-cache-memory-bytes", str(2**24),
        "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(connector),
    ]  # fmt: skip
    log_path = work / "vllm-server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    try:

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(
                    f"vLLM's server exited ({process.returncode}):\n{log_path.read_text()[-3000:]}"
                )
            return status_code(f"{url}/v1/models") == 200

        eventually(up, "vLLM's OpenAI server", timeout=START_TIMEOUT_S, interval=1.0)
        yield f"{url}/v1"
    finally:
        terminate(process, group=True)


def generate_offline_data(endpoint: str, model_dir: Path, prepared: Path, out: Path) -> Path:
    """`speculators generate-offline-data` on the prepare-data directory; the directory of its files."""
    done = subprocess.run(
        [
            sys.executable, "-m", "speculators", "generate-offline-data",
            "--model", str(model_dir), "--endpoint", endpoint, "--preprocessed-data", str(prepared),
            "--output", str(out), "--concurrency", "1", "--fail-on-error", "--validate-outputs",
        ],
        capture_output=True,
        text=True,
        timeout=DATAGEN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, f"generate-offline-data failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return out


def select_capture_ids(files: Path, captured: list[int], wanted: list[int], out: Path) -> Path:
    """Each file of `files` (slots `captured`, vLLM capture ids) with only the slots `wanted`: the file vLLM
    writes when it captures `wanted` (each layer is captured on its own), without a second engine."""
    out.mkdir(parents=True)
    slots = torch.tensor([captured.index(k) for k in wanted])
    paths = sorted(files.glob("hs_*.safetensors"))
    assert paths, f"no hs_*.safetensors in {files}"
    for path in paths:
        tensors = load_file(path)
        assert tensors["hidden_states"].shape[1] == len(captured), (path, tensors["hidden_states"].shape)
        tensors["hidden_states"] = tensors["hidden_states"].index_select(1, slots).contiguous()
        save_file(tensors, out / path.name)
    return out
