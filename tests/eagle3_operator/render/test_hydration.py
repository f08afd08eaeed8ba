"""A Hugging Face source's hydration Job: one download the server pods wait for, no server pod until it
has finished, pods no server selector picks, a name that changes with what it downloads (not with how:
the source's env and resources), and that env and those resources on its download container."""

from eagle3_operator.render.children import build_children
from eagle3_operator.render.hydration import hydration_job_name

from support.rendering import (
    DNS_1035,
    HF_SOURCE,
    LONG_NAME,
    UID,
    children,
    flag,
    job_of,
    make_spec,
    pod_of,
    server_of,
)


def test_hugging_face_source_is_downloaded_once_by_a_job_the_pods_wait_for():
    source = {
        "huggingFace": {
            "repo": "org/tiny-model",
            "revision": "refs/pr/3",
            "cacheClaimName": "hf-cache",
            "tokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN"},
        }
    }
    spec = make_spec(source, replicas=3)
    job, pod, server = job_of(spec), pod_of(spec), server_of(spec)
    (download,) = job["spec"]["template"]["spec"]["containers"]
    command = download["command"]
    assert command[:4] == ["eagle3-target", "hydrate", "--repo", "org/tiny-model"]
    assert flag(command, "--revision") == "refs/pr/3"
    target_dir = flag(command, "--local-dir")
    assert target_dir == "/models/huggingface/org/tiny-model/refs--pr--3"
    assert flag(command, "--progress-port") == str(download["ports"][0]["containerPort"])
    assert flag(server["command"], "--model") == target_dir
    assert flag(server["command"], "--revision") == "refs/pr/3"
    token = next(e for e in download["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert "HF_TOKEN" not in {e["name"] for e in server["env"]}  # the server never needs the Hub token
    job_pod = job["spec"]["template"]["spec"]
    assert job_pod["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    assert {"name": "model", "mountPath": "/models"} in download["volumeMounts"]  # writable for the download
    assert (
        job_pod["restartPolicy"] == "Never"
        and download["terminationMessagePolicy"] == "FallbackToLogsOnError"
    )
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]  # exit 2: a download that cannot succeed
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]
    # The server pods only wait for the marker the Job writes last, reading the claim.
    (wait,) = pod["initContainers"]
    assert wait["command"] == ["eagle3-target", "wait-for-model", "--local-dir", target_dir]
    assert all(m.get("readOnly") for c in (wait, server) for m in c["volumeMounts"] if m["name"] == "model")
    assert download["securityContext"] == server["securityContext"] == wait["securityContext"]


def test_no_server_pod_is_asked_for_until_the_cache_is_hydrated():
    spec = make_spec(HF_SOURCE, replicas=3)
    pending = build_children("tiny", "ml", UID, spec, pod_monitor_supported=False, hydrated=False)
    deployment = next(child for child in pending if child["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 0
    assert children(spec)["Deployment"]["spec"]["replicas"] == 3


def test_hydration_pods_are_selected_by_nothing_that_selects_server_pods():
    spec = make_spec(HF_SOURCE, replicas=3, networkPolicy={"enabled": True})
    rendered = children(spec)
    labels = rendered["Job"]["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "model-hydration"
    assert labels["app.kubernetes.io/instance"] == "tiny"  # the operator's pod index finds them by target
    for selector in (
        rendered["Service"]["spec"]["selector"],
        rendered["Deployment"]["spec"]["selector"]["matchLabels"],
        rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        rendered["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"],
    ):
        assert not selector.items() <= labels.items()


def test_the_job_is_named_for_what_it_downloads():
    """A Job's pod template cannot change: a different download is a different Job; the same one keeps it."""
    names = {
        hydration_job_name("tiny", make_spec(source))
        for source in (
            HF_SOURCE,
            {"huggingFace": {**HF_SOURCE["huggingFace"], "revision": "v2"}},
            {"huggingFace": {**HF_SOURCE["huggingFace"], "cacheClaimName": "other-cache"}},
            {"huggingFace": {**HF_SOURCE["huggingFace"], "repo": "org/other"}},
        )
    }
    assert len(names) == 4
    assert hydration_job_name("tiny", make_spec(HF_SOURCE, replicas=5)) in names
    assert hydration_job_name("tiny", make_spec()) is None
    long_name = hydration_job_name(LONG_NAME, make_spec(HF_SOURCE))
    assert len(long_name) <= 63 and DNS_1035.match(long_name)


def test_how_the_download_runs_leaves_the_jobs_name():
    """A mirror, a proxy or more memory is the same download: the Job keeps its name (child_applier replaces
    one that has not completed)."""
    tuned = {
        "huggingFace": {
            **HF_SOURCE["huggingFace"],
            "env": [{"name": "HF_ENDPOINT", "value": "https://hub-mirror.example"}],
            "resources": {"limits": {"memory": "16Gi"}},
        }
    }
    assert hydration_job_name("tiny", make_spec(tuned)) == hydration_job_name("tiny", make_spec(HF_SOURCE))
    assert job_of(make_spec(tuned)) != job_of(make_spec(HF_SOURCE))


def test_the_sources_env_follows_the_operators_and_replaces_a_default_it_names():
    env = [
        {"name": "HF_ENDPOINT", "value": "https://hub-mirror.example"},
        {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "url"}}},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "0"},
    ]
    source = {"huggingFace": {**HF_SOURCE["huggingFace"], "tokenSecretRef": {"name": "hf"}, "env": env}}
    (download,) = job_of(make_spec(source))["spec"]["template"]["spec"]["containers"]
    names = [var["name"] for var in download["env"]]
    assert names[-3:] == ["HF_ENDPOINT", "HTTPS_PROXY", "HF_HUB_DISABLE_TELEMETRY"]
    assert names.count("HF_HUB_DISABLE_TELEMETRY") == 1  # an env list is keyed by name
    assert {"HF_HOME", "HF_TOKEN", "HOME", "TMPDIR"} <= set(names[:-3])
    assert download["env"][-2] == env[1]
    assert all(var["name"] != "HF_ENDPOINT" for var in server_of(make_spec(source))["env"])


def test_the_download_resources_default_and_are_replaced_whole():
    (default,) = job_of(make_spec(HF_SOURCE))["spec"]["template"]["spec"]["containers"]
    assert default["resources"] == {
        "requests": {"ephemeral-storage": "256Mi", "cpu": "1", "memory": "1Gi"},
        "limits": {"ephemeral-storage": "2Gi", "cpu": "4", "memory": "4Gi"},
    }
    source = {"huggingFace": {**HF_SOURCE["huggingFace"], "resources": {"limits": {"memory": "16Gi"}}}}
    (tuned,) = job_of(make_spec(source))["spec"]["template"]["spec"]["containers"]
    assert tuned["resources"] == {
        "requests": {"ephemeral-storage": "256Mi"},
        "limits": {"ephemeral-storage": "2Gi", "memory": "16Gi"},
    }
