"""The GPU quick start (examples/llama-3.1-8b/, examples/helm-values.yaml) applied as a user applies it, on
the local control plane: the README's Install commands (the namespace, `helm install` with the example
values) without their `--set` image flags, which name the user's registry, then the README's quick-start
commands as written (the Secrets, with HF_TOKEN set, the trainer's ConfigMap, `kubectl apply` of the
directory, `kubectl wait` for Ready, `kubectl get`); then the training Job's own command, authenticated as
the Job's ServiceAccount, resolves the target by name and trains against it, and that ServiceAccount may do
nothing else.

What differs from a GPU cluster, made in memory by `applied_manifests` (target.yaml only; no other file is
changed):
- the model (model.name and source.huggingFace.repo) is a tiny random-weight Llama with the example's 32
  layers, placed in the cache claim's volume as `eagle3-target hydrate` leaves a finished download (the
  snapshot and its completion marker), since nothing here reaches the Hub; the download Job still runs, and
  finds it complete;
- engine hf without vLLM's engineArgs: vLLM's CPU build needs over a minute to start even a tiny model
  (tests/examples/test_demo.py covers it), the HF engine seconds;
- small resources, and placement on the test kubelet's node (support/kubelet.py runs the download and
  server containers there as processes).
The cache claim binds to a hostPath PersistentVolume made for it (there is no provisioner). The operator runs
as a local process with the release's ServiceAccount and args (support/chart_release.py). The Job's pod lands
on a simulated GPU node, which completes it without running it; the test runs the Job's command itself, with
its Secret and ConfigMap volumes written as a kubelet writes them, --device=cpu and fewer --steps.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import kubernetes
import pytest
import yaml
from eagle3_target.hydrate import HYDRATION_MARKER
from eagle3_target.protocol import GROUP, PLURAL, VERSION
from eagle3_target.tiny import write_tiny_model

from support.chart_release import ReleaseOperator
from support.cluster import nodes
from support.cluster.access import BIN_DIR, HELM_ENV, REPO, Cluster
from support.kubelet import Kubelet, register_node, write_secret_volume

EXAMPLE = REPO / "examples" / "llama-3.1-8b"
VALUES = REPO / "examples" / "helm-values.yaml"
NAMESPACE = "ml-training"
RELEASE, OPERATOR_NAMESPACE = "eagle3-operator", "eagle3-system"
TARGET = "llama31-8b"
TINY_REPO = "eagle3-tests/tiny-llama"
STEPS = 6
# The README's quick start: the commands between these markers run as they are written (bash, in the
# repository's root), except APPLY, which the test runs with its substitutions. Before them, the README's
# Install block that runs `helm install`, without its --set flags (they name the user's registry).
BEGIN = "<!-- quick start: applied by tests/examples/test_quickstart.py -->"
END = "<!-- end of quick start -->"
APPLY = "kubectl apply -f examples/llama-3.1-8b/"
# A README command's limit: `kubectl wait` covers the download Job, the operator and a 32-layer model's start
# on a loaded CI machine.
COMMAND_TIMEOUT = 300


def bash_commands(block: str) -> list[str]:
    """The commands of a fenced bash block: continuation lines joined, comments and blank lines dropped."""
    assert block.startswith("```bash\n") and block.endswith("\n```"), block
    joined = block.removeprefix("```bash\n").removesuffix("\n```").replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return bash_commands(text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip())


def install_commands() -> list[str]:
    """The README's Install block with `helm install`, each command without its `--set NAME=VALUE` flags."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Install\n") :]
    section = section[: section.index("\n## ", 1)]
    (block,) = [b for b in re.findall(r"```bash\n.*?\n```", section, re.S) if "helm install " in b]
    commands = []
    for command in bash_commands(block):
        words = shlex.split(command)
        while "--set" in words:
            at = words.index("--set")
            del words[at : at + 2]
        commands.append(shlex.join(words))
    assert any(c.startswith(f"helm install {RELEASE} charts/eagle3-operator") for c in commands), commands
    return commands


@dataclass
class QuickStart:
    cluster: Cluster
    work: Path
    outputs: dict[str, str]  # each README command run: what it printed

    @property
    def target_token(self) -> str:
        core = kubernetes.client.CoreV1Api(self.cluster.api_client)
        data = core.read_namespaced_secret("llama31-8b-token", NAMESPACE).data or {}
        return base64.b64decode(data["token"]).decode()

    def run(self, command: str) -> None:
        """A command of the README, as a user's shell runs it."""
        environment = (
            os.environ
            | HELM_ENV
            | {
                "KUBECONFIG": str(self.cluster.kubeconfig),
                "PATH": f"{BIN_DIR}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                "HF_TOKEN": "hf_not-used-here",
            }
        )
        try:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=REPO,
                env=environment,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
            )
        except subprocess.TimeoutExpired as expired:
            raise AssertionError(
                f"{command} ran past {COMMAND_TIMEOUT}s:\n{self.target_state()}"
            ) from expired
        if done.returncode != 0:
            raise AssertionError(f"{command} exited {done.returncode}:\n{done.stderr}\n{self.target_state()}")
        self.outputs[command] = done.stdout

    def target_state(self) -> str:
        """The target and its pods and Jobs as the cluster has them: what a failed command leaves to read."""
        target = self.kubectl("get", "e3t", "-n", NAMESPACE, "-o", "yaml", check=False).stdout
        workloads = self.kubectl("get", "pods,jobs", "-n", NAMESPACE, "-o", "wide", check=False).stdout
        return f"{target}\n{workloads}"

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check)

    def trainer_kubeconfig(self) -> Path:
        """A kubeconfig for ServiceAccount eagle3-trainer (a TokenRequest), as the Job's pod would have."""
        return self.cluster.write_service_account_kubeconfig(
            NAMESPACE, "eagle3-trainer", self.work / "trainer.kubeconfig"
        )


def placed_download(cache: Path, revision: str) -> None:
    """The tiny model where the hydration Job downloads TINY_REPO@revision in the claim, as `hydrate` leaves
    a finished download: the snapshot, then the completion marker."""
    snapshot = write_tiny_model(cache / "huggingface" / TINY_REPO / revision, arch="llama", num_layers=32)
    files = [f for f in snapshot.rglob("*") if f.is_file()]
    marker = {
        "repo": TINY_REPO,
        "revision": revision,
        "commit": revision,
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "finished": "2026-01-01T00:00:00Z",
    }
    (snapshot / HYDRATION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def applied_manifests() -> str:
    """Every file of the example directory, target.yaml with the substitutions the module docstring lists."""
    documents = []
    for path in sorted(EXAMPLE.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document["kind"] == "Eagle3Target":
                spec = document["spec"]
                spec["model"]["name"] = spec["model"]["source"]["huggingFace"]["repo"] = TINY_REPO
                spec["engine"] = "hf"
                del spec["engineArgs"]
                spec["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}}
                placement = nodes.kubelet_placement()
                spec["nodeSelector"] = placement["nodeSelector"]
                spec["tolerations"] += placement["tolerations"]
            documents.append(document)
    return yaml.safe_dump_all(documents, sort_keys=False)


def hub_revision() -> str:
    (target,) = [d for d in yaml.safe_load_all((EXAMPLE / "target.yaml").read_text())]
    return str(target["spec"]["model"]["source"]["huggingFace"]["revision"])


@pytest.fixture(scope="module")
def quickstart(cluster: Cluster, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuickStart]:
    work = tmp_path_factory.mktemp("quickstart")
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    register_node(core)
    cache = work / "hf-cache"
    placed_download(cache, hub_revision())
    volume = f"{NAMESPACE}-hf-cache-{secrets.token_hex(3)}"
    core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "accessModes": ["ReadWriteOnce"],
                "hostPath": {"path": str(cache)},
                "claimRef": {"namespace": NAMESPACE, "name": "hf-cache"},
                "persistentVolumeReclaimPolicy": "Retain",
            },
        }
    )
    state = QuickStart(cluster, work, {})
    operator: ReleaseOperator | None = None
    kubelet: Kubelet | None = None
    try:
        for command in install_commands():
            state.run(command)
        operator = ReleaseOperator(cluster, RELEASE, OPERATOR_NAMESPACE, work)
        operator.start()
        kubelet = Kubelet(core, NAMESPACE, work)
        commands = readme_commands()
        assert APPLY in commands, commands
        for command in commands:
            if command == APPLY:
                cluster.kubectl("apply", "-f", "-", input=applied_manifests())
            else:
                state.run(command)
        yield state
    finally:
        if kubelet is not None:
            kubelet.close()
        if operator is not None:
            operator.stop()
            print(f"operator log: {operator.log_path}")
        cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, check=False)
        for namespace in (NAMESPACE, OPERATOR_NAMESPACE):
            cluster.kubectl("delete", "namespace", namespace, "--timeout=90s", check=False)
        cluster.kubectl("delete", "persistentvolume", volume, "--wait=false", check=False)


def test_the_quick_start_reaches_ready_from_the_downloaded_cache(quickstart: QuickStart):
    (wait,) = [command for command in quickstart.outputs if command.startswith("kubectl wait ")]
    assert f"eagle3target.eagle3.dev/{TARGET} condition met" in quickstart.outputs[wait]
    header, row = quickstart.outputs[f"kubectl get e3t -n {NAMESPACE}"].splitlines()
    assert header.split() == [
        "NAME", "READY", "REASON", "AVAILABLE", "READY/DESIRED", "ENGINE", "MODEL", "CONSUMERS", "URL", "AGE"
    ]  # fmt: skip
    url = f"http://llama31-8b.{NAMESPACE}.svc:8000"
    assert re.match(rf"{TARGET}\s+True\s+AllReplicasReady\s+True\s+1/1\s+hf\s+{TINY_REPO}\s+\d+\s+{url}", row)
    jobs = kubernetes.client.BatchV1Api(quickstart.cluster.api_client).list_namespaced_job(NAMESPACE).items
    (download,) = [j for j in jobs if j.metadata.name != "train-draft"]
    assert download.status.succeeded == 1  # its pod ran `eagle3-target hydrate`, which found it complete


def test_the_training_job_trains_by_name_as_its_service_account(quickstart: QuickStart):
    (job,) = yaml.safe_load_all((EXAMPLE / "train-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "eagle3-trainer" and pod["automountServiceAccountToken"] is True
    (container,) = pod["containers"]
    core = kubernetes.client.CoreV1Api(quickstart.cluster.api_client)
    volumes = {v["name"]: v for v in pod["volumes"]}
    on_host: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        directory = quickstart.work / "job-volumes" / mount["name"]
        directory.mkdir(parents=True)
        volume = volumes[mount["name"]]
        if "secret" in volume:
            write_secret_volume(core, NAMESPACE, volume["secret"], directory)
        else:  # the ConfigMap `kubectl create configmap` made
            data = core.read_namespaced_config_map(volume["configMap"]["name"], NAMESPACE).data or {}
            for key, text in data.items():
                (directory / key).write_text(text)
        on_host[mount["mountPath"]] = directory

    def host_arg(arg: str) -> str:
        flag, _, value = arg.rpartition("=")
        for mount, directory in on_host.items():
            if value.startswith(mount + "/"):
                value = str(directory) + value[len(mount) :]
        return f"{flag}={value}" if flag else value

    argv = [host_arg(arg) for arg in container["command"]]
    assert argv[0] == "python3" and "--target=llama31-8b" in argv and not any("--url" in a for a in argv)
    argv[0] = sys.executable
    argv = [{"--device=cuda": "--device=cpu", "--steps=200": f"--steps={STEPS}"}.get(a, a) for a in argv]
    env = {e["name"]: e["value"] for e in container["env"]}
    env |= {"KUBECONFIG": str(quickstart.trainer_kubeconfig()), "NO_PROXY": "*"}
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")} | env
    done = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"{STEPS}/{STEPS}" in output  # tqdm's last update: every step trained
    assert re.search(r"last \d+ steps: loss \d+\.\d+, top-1 accuracy", output), output[-2000:]

    # The README's resolve, as the trainer: by name, the endpoint the kubelet's pod serves at.
    resolved = subprocess.run(
        [str(Path(sys.executable).parent / "eagle3-target"), "resolve", TARGET, "-n", NAMESPACE],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resolved.returncode == 0, resolved.stderr
    endpoint = re.search(rf"http://127\.{nodes.POD_NET}\.\d+\.\d+:8000", resolved.stdout)
    assert endpoint, resolved.stdout
    # The trainer got supervision through the target's bearer auth: without the token it is refused.
    with httpx.Client(trust_env=False) as client:
        lm_head = f"{endpoint.group(0)}/v1/weights/lm_head"  # a data route the trainer read
        assert client.get(lm_head).status_code == 401
        bearer = {"Authorization": f"Bearer {quickstart.target_token}"}
        assert client.get(lm_head, headers=bearer).status_code == 200


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("get", f"{PLURAL}/{TARGET}", True),
        ("list", f"{PLURAL}/{TARGET}", True),
        ("watch", f"{PLURAL}/{TARGET}", True),
        ("patch", f"{PLURAL}/{TARGET}", True),
        ("delete", f"{PLURAL}/{TARGET}", False),
        ("create", PLURAL, False),
        ("get", f"{PLURAL}/another-target", False),
        ("get", "secrets/llama31-8b-token", False),
        ("get", "secrets/hf-token", False),
        ("list", "pods", False),
    ],
)
def test_the_trainers_role_grants_exactly_what_resolve_needs(
    quickstart: QuickStart, verb: str, resource: str, allowed: bool
):
    """A SelfSubjectAccessReview as the trainer (the token Secret reaches the Job as a volume, so the Role
    grants nothing on Secrets)."""
    kubeconfig = str(quickstart.trainer_kubeconfig())
    answer = quickstart.kubectl(
        "--kubeconfig", kubeconfig, "auth", "can-i", verb, resource, "-n", NAMESPACE, check=False
    )
    assert answer.stdout.strip() == ("yes" if allowed else "no"), answer.stderr


def test_a_forbidden_call_is_refused_for_real(quickstart: QuickStart):
    kubeconfig = str(quickstart.trainer_kubeconfig())
    refused = quickstart.kubectl(
        "--kubeconfig",
        kubeconfig,
        "delete",
        f"e3t/{TARGET}",
        "-n",
        NAMESPACE,
        "--dry-run=server",
        check=False,
    )
    assert refused.returncode != 0 and "Forbidden" in refused.stderr


def test_the_trainer_lists_and_watches_its_target_alone_as_resolve_does(quickstart: QuickStart):
    """resolve watches the target with the field selector metadata.name=NAME, which the Role's resourceNames
    admit; a listing of every target is refused."""
    trainer = kubernetes.config.new_client_from_config(str(quickstart.trainer_kubeconfig()))
    custom = kubernetes.client.CustomObjectsApi(trainer)
    by_name = f"metadata.name={TARGET}"
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, field_selector=by_name)
    assert [item["metadata"]["name"] for item in listed["items"]] == [TARGET]
    watch = custom.list_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, field_selector=by_name, watch=True, timeout_seconds=1,
        _preload_content=False,
    )  # fmt: skip
    assert watch.status == 200 and TARGET in watch.data.decode()
    with pytest.raises(kubernetes.client.ApiException) as refused:
        custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
    assert refused.value.status == 403


def test_the_network_policy_admits_the_trainers_and_prometheus(quickstart: QuickStart):
    """Training jobs (ml-training) and the operator reach the data port, Prometheus (the chart's
    targets.prometheusNamespace) the metrics port, and no one else either."""
    networking = kubernetes.client.NetworkingV1Api(quickstart.cluster.api_client)
    (policy,) = networking.list_namespaced_network_policy(NAMESPACE).items
    admitted = {
        rule.ports[0].port: sorted(
            name for peer in rule._from for name in peer.namespace_selector.match_expressions[0].values
        )
        for rule in policy.spec.ingress
    }
    assert admitted == {"http": [OPERATOR_NAMESPACE, NAMESPACE], "metrics": ["monitoring"]}


def test_every_other_example_passes_a_server_side_dry_run(cluster: Cluster, crd: None, namespace: str):
    """The local demo's target (applied for real by `make demo`) and the chart as the example values render
    it (installed for real above)."""
    examples = {p.relative_to(REPO / "examples") for p in (REPO / "examples").rglob("*.yaml")}
    quickstart_dir = {p.relative_to(REPO / "examples") for p in EXAMPLE.glob("*.yaml")}
    assert examples - quickstart_dir == {Path("helm-values.yaml"), Path("quickstart.yaml")}
    applied = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", str(REPO / "examples" / "quickstart.yaml")
    )
    assert "eagle3target.eagle3.dev/quickstart created (server dry run)" in applied.stdout
    rendered = cluster.helm(
        "template", RELEASE, str(REPO / "charts" / "eagle3-operator"), "-n", namespace, "-f", str(VALUES)
    ).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    # A Role where the values name a namespace: the dry run needs that namespace to exist.
    for document in objects:
        if document["metadata"].get("namespace") == NAMESPACE:
            document["metadata"]["namespace"] = namespace
    applied = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects)
    )
    assert "deployment.apps/eagle3-operator created (server dry run)" in applied.stdout


def test_the_training_job_meets_the_restricted_pod_security_standard(cluster: Cluster, namespace: str):
    """docs/security.md suggests enforcing `restricted` on the namespace: the API server's PodSecurity
    admission finds nothing in the Job's pod template, and does find the Job without its securityContexts
    (the check is live)."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/warn=restricted")
    (job,) = yaml.safe_load_all((EXAMPLE / "train-job.yaml").read_text())
    job["metadata"]["namespace"] = namespace

    def admission_warnings(document: object) -> str:
        applied = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(document))
        return applied.stderr

    assert "would violate PodSecurity" not in admission_warnings(job)
    pod = job["spec"]["template"]["spec"]
    del pod["securityContext"], pod["containers"][0]["securityContext"]
    assert 'would violate PodSecurity "restricted' in admission_warnings(job)
