"""`make demo`: the whole product on this machine, as a platform engineer and a training job would use it.

1. a local Kubernetes control plane (built from Go modules; kwok simulates two 8-GPU nodes whose pods get
   loopback IPs),
2. `helm install` of the operator chart, watching one namespace,
3. the operator, run as a local process with the chart's ServiceAccount credentials (no image can be built
   here), so it has exactly the chart's RBAC,
4. a tiny random-weight model whose config is on the node but whose weights are still being copied, and
   `kubectl apply -f examples/quickstart.yaml` (with `--engine vllm`, `make demo ENGINE=vllm`: the same
   target on the vLLM engine, which here is vLLM's CPU build),
5. for every pod the Deployment gets, the pod's own `eagle3-target serve` command line run for real at the
   pod's IP (what the kubelet would do; kwok only pretends to run containers),
6. the target's progress as its server reports it (waiting for the weights, then loading them), the weights
   arriving, `kubectl wait --for=condition=Ready`, then as a training job: resolve the target by name, pull
   supervision, and print a report,
7. teardown of everything it started, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import kubernetes
import torch
import typer
import yaml
from eagle3_operator.render.names import selector_labels
from eagle3_target.client import TargetClient, resolve
from eagle3_target.engines import ENGINES
from eagle3_target.protocol import GROUP, PLURAL, VERSION
from eagle3_target.tiny import write_tiny_model

from support.chart_release import service_account
from support.cluster import plane
from support.cluster.access import Cluster
from support.cluster.processes import terminate
from support.cluster.waiting import direct_opener, eventually, free_port

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
TARGET = "quickstart"
TARGET_NAMESPACE = "default"
OPERATOR_NAMESPACE = "eagle3-system"
RELEASE = "eagle3-operator"
BATCH, SEQUENCE = 4, 128
# What the quickstart becomes on the vLLM engine: one (here simulated) GPU per pod, as vLLM needs, an eager
# engine (compiling a tiny model on CPU doubles its start), and room for that start.
VLLM_SPEC = {
    "engine": "vllm",
    "tensorParallelSize": 1,
    "engineArgs": {"enforce_eager": "true"},
    "startupTimeoutSeconds": 300,
}
_started = time.monotonic()


def step(message: str) -> None:
    print(f"\n==> [{time.monotonic() - _started:5.1f}s] {message}", flush=True)


def venv_script(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@contextlib.contextmanager
def process(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process in its own group, logging to a file, stopped (TERM, then KILL) on exit."""
    with log.open("wb") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield child
    finally:
        terminate(child, grace_seconds=15, group=True)


def install_chart(cluster: Cluster) -> str:
    """helm install the operator chart, serving only TARGET_NAMESPACE; returns its ServiceAccount's name."""
    cluster.helm(
        "install", RELEASE, str(REPO / "charts" / "eagle3-operator"),
        "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
        "--set", f"watchNamespaces={{{TARGET_NAMESPACE}}}",
    )  # fmt: skip
    return service_account(cluster, RELEASE, OPERATOR_NAMESPACE)


class PodServers:
    """Runs each target pod's own `eagle3-target serve` command at the pod's IP, as a kubelet would run its
    container: the command line comes from the pod the operator rendered, with the model volume's hostPath
    in place of the in-container mount and the pod's IP in place of 0.0.0.0."""

    def __init__(self, cluster: Cluster, stack: contextlib.ExitStack, logs: Path) -> None:
        self.core = kubernetes.client.CoreV1Api(cluster.api_client)
        self.stack = stack
        self.logs = logs
        self.serving: dict[str, str] = {}  # pod name -> address

    def sync(self) -> dict[str, str]:
        """Start a server for each pod that has an IP and none yet; returns every pod served so far."""
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(TARGET).items())
        for pod in self.core.list_namespaced_pod(TARGET_NAMESPACE, label_selector=selector).items:
            assert pod.metadata is not None and pod.metadata.name is not None and pod.status is not None
            if pod.metadata.name in self.serving or not pod.status.pod_ip:
                continue
            argv = self.host_command(pod)
            log = self.logs / f"server-{pod.metadata.name}.log"
            self.stack.enter_context(process(argv, log))
            self.serving[pod.metadata.name] = pod.status.pod_ip
            print(f"    {pod.metadata.name}: serving at {pod.status.pod_ip} (log {log})", flush=True)
        return self.serving

    @staticmethod
    def host_command(pod: kubernetes.client.V1Pod) -> list[str]:
        assert pod.spec is not None and pod.status is not None  # a scheduled pod has both
        container = next(c for c in pod.spec.containers if c.command and "serve" in c.command)
        mounts = {m.name: m.mount_path for m in container.volume_mounts or ()}
        host_paths = {v.name: v.host_path.path for v in pod.spec.volumes or () if v.host_path}
        on_host = {mounts[name]: path for name, path in host_paths.items() if name in mounts}
        argv = list(container.command or ()) + list(container.args or ())
        for flag, value in (("--model", None), ("--host", pod.status.pod_ip)):
            index = argv.index(flag) + 1
            argv[index] = value or on_host.get(argv[index], argv[index])
        argv[0] = venv_script(argv[0])
        return argv


class ProgressNarration:
    """Prints the target's Progressing message each time it changes: what `kubectl get e3t -w` would show."""

    def __init__(self, cluster: Cluster) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
        self.seen: list[str] = []

    def poll(self) -> str:
        body: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]  # JSON
            GROUP, VERSION, TARGET_NAMESPACE, PLURAL, TARGET
        )
        conditions = (body.get("status") or {}).get("conditions") or []
        progressing = next((c for c in conditions if c["type"] == "Progressing"), None)
        if progressing is not None and progressing["status"] == "True":
            message = progressing["message"]
            if not self.seen or self.seen[-1] != message:
                self.seen.append(message)
                print(f"    Progressing: {message}", flush=True)
        return self.seen[-1] if self.seen else ""


def report(cluster: Cluster) -> None:
    step(f"a training job resolves {TARGET!r} by name and pulls supervision")
    target = resolve(TARGET, TARGET_NAMESPACE, wait=60, kubeconfig=str(cluster.kubeconfig))
    print(f"    url:         {target.url}")
    print(f"    endpoints:   {', '.join(target.endpoints)}")
    print(f"    fingerprint: {target.fingerprint}")
    model = target.model
    assert model is not None  # a Ready target publishes the model its servers reported
    print(f"    model:       {model.name} ({model.engine}, {model.dtype}), {model.num_hidden_layers} layers,")
    print(f"                 hidden {model.hidden_size}, vocab {model.vocab_size}, aux {model.aux_layer_ids}")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.vocab_size, (BATCH, SEQUENCE), generator=generator)
    ones = torch.ones_like(input_ids)
    with TargetClient(target.urls) as client:
        batch = client.batch(input_ids, ones, ones, format="hidden")  # warm-up: fetches the LM head once
        rounds, began = 5, time.perf_counter()
        for _ in range(rounds):
            batch = client.batch(input_ids, ones, ones, format="hidden")
        seconds = time.perf_counter() - began
        wire = client.stats
    print(f"    batch of {BATCH} x {SEQUENCE} tokens, format 'hidden' (the client applies the LM head):")
    for name in ("aux_hidden_states", "input_ids", "attention_mask", "loss_mask", "logits"):
        tensor = getattr(batch, name)
        print(f"      {name:<18} {tuple(tensor.shape)!s:<16} {str(tensor.dtype).removeprefix('torch.')}")
    print(f"    throughput:  {rounds * BATCH * SEQUENCE / seconds:,.0f} tokens/s over {rounds} batches "
          f"(client stats: {dict(wire)})")  # fmt: skip


def quickstart(engine: str) -> str:
    """examples/quickstart.yaml for `engine` (it is written for hf)."""
    manifest = yaml.safe_load(QUICKSTART.read_text())
    if engine == "vllm":
        manifest["spec"] |= VLLM_SPEC
    return yaml.safe_dump(manifest, sort_keys=False)


def main(
    engine: Annotated[str, typer.Option(help=f"the target's engine, one of {', '.join(ENGINES)}")] = "hf",
) -> None:
    if engine not in ENGINES:
        raise typer.BadParameter(f"expected one of {', '.join(ENGINES)}", param_hint="--engine")
    work = Path(tempfile.mkdtemp(prefix="eagle3-demo-"))
    with contextlib.ExitStack() as stack:
        # The model is written while the control plane starts (both take seconds; neither needs the other).
        modelling = stack.enter_context(ThreadPoolExecutor(max_workers=1))
        model = modelling.submit(write_tiny_model, work / "tiny-llama", arch="llama")
        step("starting a local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)")
        running = plane.start(work / "cluster", detached=False)
        stack.callback(running.stop)
        cluster = running.cluster()
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product", "-o", "wide").stdout)
        print(cluster.kubectl(
            "get", "nodes", "-o",
            "custom-columns=NODE:.metadata.name,GPUS:.status.allocatable.nvidia\\.com/gpu,PODCIDR:.spec.podCIDR",
        ).stdout)  # fmt: skip

        step(f"helm install {RELEASE} (watching namespace {TARGET_NAMESPACE!r})")
        account = install_chart(cluster)
        print(cluster.helm("list", "-n", OPERATOR_NAMESPACE).stdout)

        step(f"starting the operator as ServiceAccount {OPERATOR_NAMESPACE}/{account} (the chart's RBAC)")
        operator_kubeconfig = cluster.write_service_account_kubeconfig(
            OPERATOR_NAMESPACE, account, work / "operator.kubeconfig"
        )
        liveness = free_port()
        operator_argv = [
            venv_script("eagle3-operator"), "--namespace", TARGET_NAMESPACE,
            "--liveness", f"http://127.0.0.1:{liveness}/healthz",
            "--metrics-port", str(free_port()), "--metrics-address", "127.0.0.1",
            "--reprobe-seconds", "2",  # a quick narration; the chart's default is 15
        ]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(operator_kubeconfig), "NO_PROXY": "*"}
        operator = stack.enter_context(process(operator_argv, work / "operator.log", env))
        eventually(lambda: _answers(f"http://127.0.0.1:{liveness}/healthz", operator), "the operator", 60)
        print(f"    operator up (log {work / 'operator.log'})")

        step("a tiny random-weight Llama-style model: its config where the quickstart's hostPath points, its")
        print("    weights still being copied (as from a slow volume)")
        staged = model.result()
        model_dir = Path("/tmp/eagle3-quickstart/tiny-llama")
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir(parents=True)
        weights = sorted(staged.glob("*.safetensors*"))
        for file in sorted(set(staged.iterdir()) - set(weights)):
            shutil.copy(file, model_dir)
        print(f"    {model_dir}: {', '.join(sorted(f.name for f in model_dir.iterdir()))}")

        step(
            f"kubectl apply -f {QUICKSTART.relative_to(REPO)}"
            + (f" (engine {engine})" if engine != "hf" else "")
        )
        applied = cluster.kubectl("apply", "-f", "-", "-n", TARGET_NAMESPACE, input=quickstart(engine))
        print(applied.stdout.strip())

        step("the operator renders a Deployment; each scheduled pod's server starts at the pod's IP")
        servers = PodServers(cluster, stack, work)
        eventually(servers.sync, "the target's pods", 120)

        step("the target's progress, as its server reports it while it waits for the weights")
        narration = ProgressNarration(cluster)
        eventually(
            lambda: (servers.sync(), "waiting for weights" in narration.poll())[1], "the load's progress", 120
        )
        step("the weights arrive; the server loads them")
        for file in weights:
            shutil.copy(file, model_dir)

        step(f"kubectl wait --for=condition=Ready e3t/{TARGET}")
        waited = subprocess.Popen(
            [str(cluster.kubectl_path), "--kubeconfig", str(cluster.kubeconfig), "-n", TARGET_NAMESPACE,
             "wait", "--for=condition=Ready", f"e3t/{TARGET}", "--timeout=180s"],
        )  # fmt: skip
        eventually(lambda: (servers.sync(), narration.poll(), waited.poll() is not None)[2], "Ready", 200)
        if waited.returncode != 0:
            raise SystemExit(f"the target did not become Ready; see {work}/operator.log and the server logs")
        print(cluster.kubectl("get", "e3t", "-n", TARGET_NAMESPACE, "-o", "wide").stdout)

        report(cluster)
        step("tearing down (servers, operator, control plane)")
    print(f"\ndone in {time.monotonic() - _started:.0f}s; logs kept in {work}")


def _answers(url: str, child: subprocess.Popen[bytes]) -> bool:
    if child.poll() is not None:
        raise SystemExit(f"exited with code {child.returncode}; see its log")
    with contextlib.suppress(OSError), direct_opener().open(url, timeout=2) as answer:
        return answer.status == 200
    return False


if __name__ == "__main__":
    try:
        typer.run(main)
    except KeyboardInterrupt:
        print("\ninterrupted: everything the demo started has been stopped", file=sys.stderr)
        sys.exit(130)
