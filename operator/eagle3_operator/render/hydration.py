"""The hydration Job of a Hugging Face source and the init container that makes server pods wait for it.

One Job per (repository, revision, cache claim, image) fills the cache claim for every replica, so N replicas
never download the same weights N times and no server pod loads a half-written snapshot.
"""

import json
from typing import Any

from eagle3_operator.constants import (
    DOWNLOAD_CONTAINER,
    HYDRATION_COMPONENT,
    HYDRATION_PROGRESS_PORT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    MANAGED_LABELS,
    MODEL_MOUNT,
    WAIT_CONTAINER,
)
from eagle3_operator.render.model_source import hf_model_dir, hf_revision, model_volume
from eagle3_operator.render.names import (
    HASH_LENGTH,
    NAME_LIMIT,
    child_metadata,
    child_name,
    fit_name,
    instance_label,
    short_hash,
)
from eagle3_operator.render.pod_parts import (
    SCRATCH_ENV,
    SCRATCH_VOLUME,
    SCRATCH_VOLUME_MOUNT,
    container_security,
    placement_and_pulls,
    pod_security,
    with_ephemeral_storage,
)
from eagle3_operator.render.server_image import ImagePin
from eagle3_operator.spec import Eagle3TargetSpec

# The download container's resources unless the source names its own (spec.model.source.huggingFace.
# resources replaces them whole; ephemeral-storage keeps its defaults unless named).
DOWNLOAD_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}}


def _download_container(spec: Eagle3TargetSpec, image: str, *, tuned: bool = True) -> dict[str, Any]:
    """The hydration Job's container: `eagle3-target hydrate` fills the cache claim from the Hub, keeping
    files already there, and marks the directory complete only once every file is whole.

    `tuned`: with the source's own env and resources, which decide how the download reaches the Hub and
    how big its pod is, not what it downloads (hydration_job_name renders without them)."""
    source = spec.hugging_face
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{MODEL_MOUNT}/.hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *SCRATCH_ENV,
    ]
    if source.token_secret_ref is not None:
        ref = source.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    resources: dict[str, Any] = DOWNLOAD_RESOURCES
    if tuned:
        env = _with_env(env, [var.model_dump(by_alias=True, exclude_none=True) for var in source.env])
        if source.resources is not None:
            resources = source.resources.model_dump(by_alias=True, exclude_defaults=True)
    return {
        "name": DOWNLOAD_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # original/ holds the checkpoint again in Meta's format, which transformers and vLLM never read.
        "command": [
            *("eagle3-target", "hydrate", "--repo", source.repo, "--revision", hf_revision(spec)),
            *("--local-dir", hf_model_dir(spec), "--exclude", "original/*"),
            *("--progress-port", str(HYDRATION_PROGRESS_PORT)),
        ],
        "env": env,
        "ports": [{"name": "progress", "containerPort": HYDRATION_PROGRESS_PORT, "protocol": "TCP"}],
        "resources": with_ephemeral_storage(resources, "256Mi", "2Gi"),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}, SCRATCH_VOLUME_MOUNT],
        # The Hub's refusal (a gated repo, a bad token, a missing revision) is the termination message;
        # a crash before it could write one leaves the tail of the log instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }


def _with_env(env: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ENV followed by EXTRA, an EXTRA entry replacing one of the same name (an env list is keyed by name:
    server-side apply refuses a name twice)."""
    named = {var["name"] for var in extra}
    return [var for var in env if var["name"] not in named] + extra


def wait_container(spec: Eagle3TargetSpec, image: str) -> dict[str, Any]:
    """Init container of every server pod: it holds the server back until the hydration Job has marked the
    download complete, so a half-downloaded model is never loaded."""
    return {
        "name": WAIT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["eagle3-target", "wait-for-model", "--local-dir", hf_model_dir(spec)],
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}],
        "resources": with_ephemeral_storage(
            {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}},
            "16Mi",
            "64Mi",
        ),
        "securityContext": container_security(),
    }


def _hydration_job_spec(
    name: str, spec: Eagle3TargetSpec, pin: ImagePin, *, tuned: bool = True
) -> dict[str, Any]:
    image = spec.image or pin.image
    pod: dict[str, Any] = {
        # Never: a failed attempt stays as a pod whose termination message says why; the Job retries.
        "restartPolicy": "Never",
        "containers": [_download_container(spec, image, tuned=tuned)],
        "volumes": [model_volume(spec)[0], SCRATCH_VOLUME],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(spec),
        **placement_and_pulls(spec),
    }
    labels = {LABEL_INSTANCE: instance_label(name), LABEL_COMPONENT: HYDRATION_COMPONENT, **MANAGED_LABELS}
    return {
        "backoffLimit": 4,
        # Exit 2 (no such repository or revision, no access): retrying cannot help, fail the Job at once.
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": DOWNLOAD_CONTAINER, "operator": "In", "values": [2]},
                }
            ]
        },
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }


def hydration_job_name(name: str, spec: Eagle3TargetSpec, pin: ImagePin = ImagePin()) -> str | None:
    """The hydration Job's name for this spec (None without a huggingFace source). It changes with what the
    Job would do, because a Job's pod template cannot change: a new source, revision, claim or image gets a
    new Job, which finds a snapshot that is already complete marked and ends at once. The source's env and
    resources are left out: a new mirror, proxy or size is not a new download, so a completed Job stands
    and the target keeps serving (child_applier replaces a Job that has not completed)."""
    if spec.model is None or spec.model.source is None or spec.model.source.hugging_face is None:
        return None
    digest = short_hash(json.dumps(_hydration_job_spec(name, spec, pin, tuned=False), sort_keys=True))
    return fit_name(f"{child_name(name)[: NAME_LIMIT - 2 * HASH_LENGTH - 11]}-hydrate-{digest}")


def build_hydration_job(
    name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any], pin: ImagePin = ImagePin()
) -> dict[str, Any] | None:
    """One download per (repository, revision, cache claim): a Job that fills the claim for every replica."""
    job_name = hydration_job_name(name, spec, pin)
    if job_name is None:
        return None
    metadata = child_metadata(job_name, name, namespace, owner)
    metadata["labels"][LABEL_COMPONENT] = HYDRATION_COMPONENT
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": _hydration_job_spec(name, spec, pin),
    }
