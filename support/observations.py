"""Observations of a target built in code: the vocabulary of the status tests, which need no cluster.
Every builder takes overrides for the fields a test varies."""

from datetime import UTC, datetime
from typing import Any

from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status.observation import DeploymentView, Observation, PodView, ProbeResult
from eagle3_target.protocol import ServedModel

T0 = datetime(2026, 11, 30, 3, 0, 0, tzinfo=UTC)
INFO = ServedModel(
    name="tiny-llama",
    revision="abc123",
    dtype="float32",
    engine="hf",
    num_hidden_layers=4,
    hidden_size=32,
    vocab_size=256,
    aux_layer_ids=[0, 1, 2],
    fingerprint="sha256:aaaa",
)


def make_spec(**overrides: Any) -> Eagle3TargetSpec:
    raw = {
        "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny"}}},
        "engine": "hf",
        "tensorParallelSize": 0,
        "replicas": 2,
        "port": 18000,
        "startupTimeoutSeconds": 600,
    }
    return Eagle3TargetSpec.parse(raw | overrides)


def make_pod(name: str, ip: str | None = "127.1.0.5", **overrides: Any) -> PodView:
    fields: dict[str, Any] = {
        "name": name,
        "ip": ip,
        "node": "gpu-0",
        "ready": True,
        "terminating": False,
        "created": T0,
        "started": T0,
        "failure": None,
    }
    return PodView(**(fields | overrides))


def make_deployment(**overrides: Any) -> DeploymentView:
    fields: dict[str, Any] = {
        "generation": 1,
        "observed_generation": 1,
        "desired": 2,
        "replicas": 2,
        "ready_replicas": 2,
        "updated_replicas": 2,
        "failure": None,
    }
    return DeploymentView(**(fields | overrides))


def observe(spec: Eagle3TargetSpec | None = None, **overrides: Any) -> Observation:
    pods = (make_pod("t-a", "127.1.0.5"), make_pod("t-b", "127.1.0.6"))
    fields: dict[str, Any] = {
        "generation": 3,
        "spec": spec or make_spec(),
        "url": "http://t.ns.svc:18000",
        "selector": "app.kubernetes.io/instance=t,app.kubernetes.io/name=eagle3-target",
        "deployment": make_deployment(),
        "pods": pods,
        "probes": {pod.name: ProbeResult(ready=True, info=INFO) for pod in pods},
    }
    return Observation(**(fields | overrides))
