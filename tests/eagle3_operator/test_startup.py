"""A target's start-up on the real control plane, with real server processes in its pods: a server that
cannot load says why in the target's status within a minute, a loading one shows its progress, and an
`engine: vllm` target (vLLM's CPU build) goes Ready and serves what the HF engine computes.

The pods run on the test kubelet's node (harness.Kubelet): each pod's own command runs as a process at the
pod's IP, and its exits reach the API server as container terminations, as a kubelet reports them.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import torch
from eagle3_target.client import TargetClient, resolve
from eagle3_target.contract import build_batch
from eagle3_target.protocol import EXIT_LOAD_FAILED, GROUP, PLURAL, VERSION
from eagle3_target.runners import load_runner
from eagle3_target.tiny import write_tiny_model

from support.cluster.access import Cluster
from support.cluster.waiting import eventually
from support.kubelet import Kubelet
from support.supervision import token_batch
from support.targets import kubelet_target_manifest
from support.vllm_runner import CPU_ENGINE_ARGS

pytestmark = pytest.mark.usefixtures("operator")

REPORT_SECONDS = 60  # the promise: the server's reason is in the target's status within a minute
VLLM_READY_SECONDS = 300  # a vLLM engine's start on a loaded two-core machine, with room


def create(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)


def target(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
    return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def warnings(cluster: Cluster, namespace: str, name: str) -> list[kubernetes.client.CoreV1Event]:
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    selector = f"involvedObject.name={name},involvedObject.kind=Eagle3Target,type=Warning"
    return core.list_namespaced_event(namespace, field_selector=selector).items


def assert_load_failure_reported(
    cluster: Cluster, kubelet: Kubelet, namespace: str, name: str, line: str
) -> dict[str, Any]:
    """The target fails with ModelLoadFailed and the server's own line within a minute of its creation,
    with one Warning event and the reason in `kubectl get`'s REASON column; no server process is left."""
    created = time.monotonic()

    def failed() -> dict[str, Any] | None:
        body = target(cluster, namespace, name)
        return body if condition(body, "Ready").get("reason") == "ModelLoadFailed" else None

    body = eventually(failed, f"{name} to report ModelLoadFailed", timeout=REPORT_SECONDS)
    assert time.monotonic() - created < REPORT_SECONDS
    ready = condition(body, "Ready")
    assert ready["status"] == "False" and line in ready["message"], ready
    assert f"container server exited with code {EXIT_LOAD_FAILED}" in ready["message"]
    assert body["status"]["lastFailure"]["reason"] == "ModelLoadFailed"
    assert line in body["status"]["lastFailure"]["message"]
    assert body["status"]["phase"] == "Failed"
    events = eventually(lambda: warnings(cluster, namespace, name), "the ModelLoadFailed event")
    assert [(e.reason, e.count or 1) for e in events] == [("ModelLoadFailed", 1)]
    assert line in events[0].message
    row = cluster.kubectl("get", "e3t", name, "-n", namespace).stdout.splitlines()
    assert row[0].split()[:3] == ["NAME", "READY", "REASON"] and row[1].split()[:3] == [
        name,
        "False",
        "ModelLoadFailed",
    ]
    [container] = kubelet.containers.values()
    assert container.process is not None and container.process.poll() == EXIT_LOAD_FAILED
    return body


def test_a_wrong_engine_argument_reaches_the_targets_status(
    cluster: Cluster, op_namespace: str, kubelet: Kubelet, tiny_llama_dir: Path
):
    manifest = kubelet_target_manifest(
        "bad-arg", tiny_llama_dir, engine="vllm", engineArgs={"no_such_arg": "2"}
    )
    create(cluster, op_namespace, manifest)
    line = "unknown engine argument no_such_arg; supported: "
    assert_load_failure_reported(cluster, kubelet, op_namespace, "bad-arg", line)


def test_an_empty_model_directory_reaches_the_targets_status(
    cluster: Cluster, op_namespace: str, kubelet: Kubelet, tmp_path: Path
):
    empty = tmp_path / "empty-volume"
    empty.mkdir()
    create(cluster, op_namespace, kubelet_target_manifest("no-model", empty))
    # The volume is mounted at /models in a real pod; this kubelet hands the server the host directory.
    line = f"{empty} has no config.json, so it is not a Hugging Face model directory; point --model at"
    assert_load_failure_reported(cluster, kubelet, op_namespace, "no-model", line)
    # The kubelet restarts it with back-off; the status keeps the server's reason, and its restart count.
    [container] = kubelet.containers.values()
    eventually(lambda: container.restarts >= 1 and container.process.poll() is not None, "a failed restart")
    message = f"container server exited with code {EXIT_LOAD_FAILED}, 1 restarts"
    eventually(
        lambda: message in condition(target(cluster, op_namespace, "no-model"), "Ready")["message"],
        "the restart in the status",
    )
    assert len(warnings(cluster, op_namespace, "no-model")) == 1


def test_a_capture_set_beyond_the_model_reaches_the_targets_status(
    cluster: Cluster, op_namespace: str, kubelet: Kubelet, tiny_llama_dir: Path
):
    """The CRD cannot know the model's depth: the server refuses the capture set at start and says why."""
    manifest = kubelet_target_manifest("too-deep", tiny_llama_dir, captureLayerIds=[1, 3, 4, 8])
    create(cluster, op_namespace, manifest)
    line = "capture layer id 8 is out of range for a model with 8 layers"
    body = assert_load_failure_reported(cluster, kubelet, op_namespace, "too-deep", line)
    assert "spec.captureLayerIds" in condition(body, "Ready")["message"]


def test_a_slow_loading_target_shows_its_progress_before_it_is_ready(
    cluster: Cluster, op_namespace: str, kubelet: Kubelet, tmp_path: Path
):
    """Weights still being copied in: the pod runs, its server waits and says so, the target's Progressing
    condition shows it; once the copy completes, the server loads and the target turns Ready."""
    model = write_tiny_model(tmp_path / "arriving", arch="llama", max_shard_size="200KB")
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) >= 2
    withheld = tmp_path / "withheld.safetensors"
    shards[-1].rename(withheld)
    create(cluster, op_namespace, kubelet_target_manifest("arriving", model))
    expected = f"waiting for weights: {len(shards) - 1} of {len(shards)} weight files present"

    def progressing() -> str | None:
        message = condition(target(cluster, op_namespace, "arriving"), "Progressing").get("message", "")
        return message if expected in message else None

    message = eventually(progressing, "the load's progress in the Progressing condition", timeout=120)
    body = target(cluster, op_namespace, "arriving")
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "Progressing")["status"] == "True"
    assert message.startswith("0/1 replicas serving; loading; ") and "arriving-" in message
    shutil.copyfile(withheld, shards[-1])

    def ready() -> bool:
        return condition(target(cluster, op_namespace, "arriving"), "Ready").get("status") == "True"

    eventually(ready, "the target to turn Ready once its weights are complete", timeout=180)
    assert not warnings(cluster, op_namespace, "arriving")


def test_a_vllm_target_goes_ready_and_serves_what_the_hf_engine_computes(
    cluster: Cluster, op_namespace: str, kubelet: Kubelet, tiny_llama_dir: Path
):
    manifest = kubelet_target_manifest(
        "vllm", tiny_llama_dir, engine="vllm", engineArgs=dict(CPU_ENGINE_ARGS), startupTimeoutSeconds=600
    )
    manifest["spec"]["model"]["dtype"] = "float32"
    create(cluster, op_namespace, manifest)

    def ready() -> bool:
        return condition(target(cluster, op_namespace, "vllm"), "Ready").get("status") == "True"

    eventually(ready, "the vLLM target to turn Ready", timeout=VLLM_READY_SECONDS)
    resolved = resolve("vllm", op_namespace, kubeconfig=str(cluster.kubeconfig))
    assert resolved.model is not None and resolved.model.engine == "vllm"
    input_ids, attention_mask, loss_mask = token_batch(seed=4, batch=2, seq=24)
    with TargetClient(resolved.urls) as client:
        got = client.batch(input_ids, attention_mask, loss_mask, format="hidden")
    hf = load_runner("hf", tiny_llama_dir, dtype="float32", device="cpu")
    want = build_batch(*hf.forward_eagle3(input_ids, attention_mask), input_ids, attention_mask, loss_mask)
    assert got.logits is not None and want.logits is not None
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states, atol=1e-4, rtol=1e-4)
    assert not warnings(cluster, op_namespace, "vllm")
