"""Shared fixtures: tiny random-weight models written once per test session (no hub access), and the
Eagle3Target CRD on the local control plane for the tests that resolve targets by name."""

from pathlib import Path

import kubernetes
import pytest
import yaml
from eagle3_target.tiny import write_tiny_model
from kubernetes.client.rest import ApiException

from tests.eagle3_target.client.helpers import CRD_FILE


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-style, untied lm_head, 8 layers, hidden 64, vocab 256, fp32, stored in several shards."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", max_shard_size="200KB")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-style, tied embeddings, 8 layers, hidden 64, vocab 256, fp32, one safetensors file."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture(scope="module")
def crd(cluster) -> None:
    """The Eagle3Target CRD, installed once if absent, and Established."""
    api = kubernetes.client.ApiextensionsV1Api(cluster.api_client)
    manifest = yaml.safe_load(CRD_FILE.read_text())
    try:
        api.create_custom_resource_definition(manifest)
    except ApiException as exc:
        if exc.status != 409:
            raise
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", f"crd/{manifest['metadata']['name']}"
    )


@pytest.fixture
def objects(cluster, crd) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(cluster.api_client)
