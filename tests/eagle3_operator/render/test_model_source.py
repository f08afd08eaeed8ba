"""Each model source's volume and path: a PVC mounted read-only at its sub-path, a hostPath directory, and
the revision a Hugging Face download fetches."""

import pytest
from eagle3_operator.spec import Eagle3TargetSpec

from support.rendering import flag, job_of, make_spec, pod_of, server_of


def test_pvc_source_mounts_the_claim_read_only_at_its_sub_path():
    spec = make_spec({"pvc": {"claimName": "weights", "subPath": "llama/8b"}})
    pod, server = pod_of(spec), server_of(spec)
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in server["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "llama/8b"}
    assert flag(server["command"], "--model") == "/models"
    assert "initContainers" not in pod


def test_host_path_source_mounts_the_directory():
    spec = make_spec({"hostPath": {"path": "/srv/models/tiny"}})
    pod, server = pod_of(spec), server_of(spec)
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/srv/models/tiny", "type": "Directory"}
    assert flag(server["command"], "--model") == "/models"
    assert "initContainers" not in pod


@pytest.mark.parametrize(
    ("hf_revision", "model_revision", "expected"),
    [("v2", "abc", "v2"), (None, "abc", "abc"), (None, None, "main")],
)
def test_hugging_face_revision_falls_back_to_the_models_then_main(hf_revision, model_revision, expected):
    hub = {"repo": "org/tiny-model", "cacheClaimName": "hf-cache"} | (
        {"revision": hf_revision} if hf_revision else {}
    )
    model = {"name": "m", "source": {"huggingFace": hub}} | (
        {"revision": model_revision} if model_revision else {}
    )
    spec = Eagle3TargetSpec.parse({"model": model})
    assert (
        flag(job_of(spec)["spec"]["template"]["spec"]["containers"][0]["command"], "--revision") == expected
    )
    assert flag(pod_of(spec)["containers"][0]["command"], "--revision") == expected
