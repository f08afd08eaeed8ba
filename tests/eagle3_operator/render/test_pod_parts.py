"""What server and download pods share: locked-down security contexts, the image's user unless the spec or
the platform decides, and the same placement and pull secrets."""

import re
from pathlib import Path

from eagle3_operator.render.pod_parts import with_ephemeral_storage

from support.rendering import (
    HF_SOURCE,
    job_of,
    make_spec,
    pod_of,
    server_of,
)


def test_pod_is_locked_down():
    pod, server = pod_of(make_spec()), server_of(make_spec())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    context = server["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] is True


def test_pod_runs_as_the_target_images_user():
    dockerfile = (Path(__file__).resolve().parents[3] / "image" / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, flags=re.MULTILINE)
    context = pod_of(make_spec())["securityContext"]
    assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user


def test_ids_are_the_images_unless_set_or_left_to_the_platform():
    custom = pod_of(make_spec(securityContext={"runAsUser": 2000, "fsGroup": 3000}))["securityContext"]
    assert (custom["runAsUser"], custom["runAsGroup"], custom["fsGroup"]) == (2000, 0, 3000)
    platform = pod_of(make_spec(securityContext={"platformAssignedIds": True}))["securityContext"]
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & platform.keys()
    # What OpenShift's restricted-v2 SCC still demands holds either way.
    assert platform["runAsNonRoot"] is True and platform["seccompProfile"] == {"type": "RuntimeDefault"}
    server = pod_of(make_spec(securityContext={"platformAssignedIds": True}))["containers"][0]
    assert server["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert server["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_download_runs_where_the_targets_pods_may_and_pulls_like_them():
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    spec = make_spec(
        HF_SOURCE,
        nodeSelector={"pool": "gpu"},
        tolerations=[toleration],
        imagePullSecrets=[{"name": "registry"}],
        priorityClassName="high",
        runtimeClassName="nvidia",
    )
    job_pod = job_of(spec)["spec"]["template"]["spec"]
    assert job_pod["nodeSelector"] == {"pool": "gpu"} and job_pod["tolerations"] == [toleration]
    assert job_pod["imagePullSecrets"] == [{"name": "registry"}]
    # The server's GPU runtime and priority are the server's: the download needs neither.
    assert "runtimeClassName" not in job_pod and "priorityClassName" not in job_pod
    assert "nvidia.com/gpu" not in str(job_pod["containers"][0]["resources"])  # no GPU for a download


def test_ephemeral_storage_defaults_never_cross_the_value_set_beside_them():
    """A default limit under the request set (or a default request over the limit set) would make the pod
    invalid: it is left out, so a large download's request is unbounded and a small limit is its own
    request."""
    big = with_ephemeral_storage({"requests": {"ephemeral-storage": "50Gi", "cpu": "1"}}, "256Mi", "2Gi")
    assert big == {"requests": {"ephemeral-storage": "50Gi", "cpu": "1"}}
    small = with_ephemeral_storage({"limits": {"ephemeral-storage": "100Mi"}}, "256Mi", "2Gi")
    assert small == {"limits": {"ephemeral-storage": "100Mi"}}
    within = with_ephemeral_storage({"requests": {"ephemeral-storage": "1Gi"}}, "256Mi", "2Gi")
    assert within == {"requests": {"ephemeral-storage": "1Gi"}, "limits": {"ephemeral-storage": "2Gi"}}
    source = {
        "huggingFace": {**HF_SOURCE["huggingFace"], "resources": {"requests": {"ephemeral-storage": "40Gi"}}}
    }
    (download,) = job_of(make_spec(source))["spec"]["template"]["spec"]["containers"]
    assert download["resources"] == {"requests": {"ephemeral-storage": "40Gi"}}
