"""Helpers shared by the client tests: fixed-port servers, seeded token batches, Eagle3Target objects."""

from __future__ import annotations

from pathlib import Path

import torch
from eagle3_target.protocol import API_VERSION, GROUP, PLURAL, VERSION

from tests.eagle3_target.server.server_process import ServerProcess, launch

TOKEN = "s3cret-token"
REPO = Path(__file__).resolve().parents[3]
CRD_FILE = REPO / "crds" / "eagle3targets.eagle3.dev.yaml"
MODEL_STATUS = {
    "name": "tiny-llama",
    "revision": "r1",
    "dtype": "float32",
    "engine": "hf",
    "numHiddenLayers": 8,
    "hiddenSize": 64,
    "vocabSize": 256,
    "auxLayerIds": [1, 3, 4],
    "fingerprint": "fp-123",
}


def start_on_port(log_dir: Path, port: int, args: list[str]) -> ServerProcess:
    """A server on a fixed port (to restart "the same" endpoint); returns as soon as the process runs."""
    return launch(log_dir / f"server-{port}-{len(list(log_dir.glob('*.log')))}.log", port, args)


def token_batch(seed: int, batch: int = 2, seq: int = 16, vocab: int = 256) -> tuple[torch.Tensor, ...]:
    """A seeded (input_ids, attention_mask, loss_mask) with a padded tail on the last row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, seq - 3 :] = 0
    loss_mask = torch.randint(0, 2, (batch, seq), generator=g) * attention_mask
    return input_ids, attention_mask, loss_mask


def create_target(objects, namespace: str, name: str) -> dict:
    body = {
        "apiVersion": API_VERSION,
        "kind": "Eagle3Target",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny"}}},
            "engine": "hf",
        },
    }
    return objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def write_status(objects, namespace: str, name: str, status: dict) -> None:
    objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})


def status(
    generation: int, ready: str, reason: str, *, ready_generation: int | None = None, port: int = 8000
) -> dict:
    condition_generation = generation if ready_generation is None else ready_generation
    return {
        "observedGeneration": generation,
        "phase": "Ready" if ready == "True" else "Loading",
        "conditions": [
            {
                "type": "Ready",
                "status": ready,
                "reason": reason,
                "message": f"{reason} at generation {generation}",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": condition_generation,
            }
        ],
        "url": f"http://tiny.ns.svc:{port}",
        "endpoints": [
            {"pod": "tiny-0", "address": f"http://127.0.0.2:{port}", "ready": True, "node": "n0"},
            {"pod": "tiny-1", "address": f"http://127.0.0.3:{port}", "ready": False, "node": "n1"},
        ],
        "model": MODEL_STATUS,
    }
