"""Where each model source (PVC, hostPath, Hugging Face download) puts the model: the volume the pods mount,
the path the server loads, and the directory and revision a Hub download fills."""

from typing import Any

from eagle3_operator.constants import MODEL_MOUNT
from eagle3_operator.spec import Eagle3TargetSpec


def hf_revision(spec: Eagle3TargetSpec) -> str:
    """The revision a huggingFace source downloads: its own, else the model's, else main."""
    return spec.hugging_face.revision or spec.managed_model.revision or "main"


def hf_model_dir(spec: Eagle3TargetSpec) -> str:
    """Where the download lands in the cache PVC: one directory per repo and revision, so they never mix."""
    return f"{MODEL_MOUNT}/huggingface/{spec.hugging_face.repo}/{hf_revision(spec).replace('/', '--')}"


def model_path(spec: Eagle3TargetSpec) -> str:
    """The `--model` path inside the server container."""
    if spec.source.hugging_face is not None:
        return hf_model_dir(spec)
    return MODEL_MOUNT


def model_volume(spec: Eagle3TargetSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model volume and the server's read-only mount of it, per source."""
    source = spec.source
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if source.pvc is not None:
        claim = {"claimName": source.pvc.claim_name, "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        if source.pvc.sub_path:
            mount["subPath"] = source.pvc.sub_path
    elif source.host_path is not None:
        volume = {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    else:
        claim = {"claimName": spec.hugging_face.cache_claim_name}
        volume = {"name": "model", "persistentVolumeClaim": claim}
    return volume, mount
