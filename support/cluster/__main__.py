"""`python -m support.cluster up|down|status`: a control plane that outlives the command, for the demo,
for poking at with kubectl, and for test runs to reuse instead of starting their own. `timing` measures
how long a private plane takes to run its first pod."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import kubernetes
import typer

from support.cluster import nodes, plane
from support.cluster.processes import ClusterStartError
from support.cluster.waiting import eventually

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.command()
def up(gpu_nodes: int = typer.Option(2, help="simulated nodes with 8 nvidia.com/gpu each")) -> None:
    """Start the plane in .cache/cluster, detached; a plane that already runs is kept."""
    running = plane.find_running()
    if running is not None:
        typer.echo(f"already up: export KUBECONFIG={running.kubeconfig}")
        return
    stale = plane.ControlPlane.load(plane.CLI_DIR)
    if stale is not None:  # some component died: take the rest down before starting afresh
        stale.stop()
    began = time.monotonic()
    try:
        started = plane.start(plane.CLI_DIR, detached=True, gpu_nodes=gpu_nodes)
    except ClusterStartError as error:
        typer.echo(f"failed: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"up in {time.monotonic() - began:.1f}s (ready at, in seconds: {started.timings})")
    typer.echo(f"logs in {started.directory}\nexport KUBECONFIG={started.kubeconfig}")


@app.command()
def down() -> None:
    """Stop every process of the plane in .cache/cluster (SIGTERM, then SIGKILL)."""
    running = plane.ControlPlane.load(plane.CLI_DIR)
    if running is None:
        typer.echo("not running")
        return
    running.stop()
    typer.echo(f"stopped {', '.join(p.name for p in running.processes)}")


@app.command()
def status() -> None:
    """Show each process and the nodes; exit 1 unless the whole plane runs."""
    running = plane.ControlPlane.load(plane.CLI_DIR)
    if running is None:
        typer.echo("not running")
        raise typer.Exit(1)
    for process in running.processes:
        state = "running" if process.alive() else "DEAD"
        typer.echo(f"{process.name:<24} pid {process.pid:<8} {state:<8} {process.log}")
    typer.echo(f"kubeconfig: {running.kubeconfig}")
    if plane.find_running() is None:
        typer.echo("the plane is not healthy: `python -m support.cluster up` restarts it")
        raise typer.Exit(1)
    for node in kubernetes.client.CoreV1Api(running.cluster().api_client).list_node().items:
        assert node.metadata and node.spec and node.status, "the API server returns nodes whole"
        gpus = (node.status.allocatable or {}).get(nodes.GPU_RESOURCE, "0")
        state = "schedulable" if nodes.schedulable(node) else "not schedulable"
        typer.echo(f"node {node.metadata.name:<8} {state:<16} gpus={gpus} podCIDR={node.spec.pod_cidr}")


@app.command()
def timing() -> None:
    """Start a private plane, run one GPU pod, stop; print seconds from start to each phase as JSON."""
    with tempfile.TemporaryDirectory(prefix="e3t-timing-") as scratch:
        began = time.monotonic()
        private = plane.start(Path(scratch) / "cluster", detached=False)
        try:
            api = private.cluster().api_client
            kubernetes.client.AppsV1Api(api).create_namespaced_deployment(
                "default",
                nodes.gpu_deployment("first", 1, 1),  # type: ignore[arg-type]  # the client sends a dict as is
            )
            core = kubernetes.client.CoreV1Api(api)

            def first_pod_ready() -> bool:
                pods = core.list_namespaced_pod("default", label_selector="app=first").items
                return any(nodes.pod_ready(pod) for pod in pods)

            eventually(first_pod_ready, "the first pod Ready", interval=0.05)
            first_ready_pod = time.monotonic() - began
        finally:
            stopping = time.monotonic()
            private.stop()
    figures = {**private.timings, "first_ready_pod": first_ready_pod, "teardown": time.monotonic() - stopping}
    typer.echo(json.dumps({name: round(seconds, 2) for name, seconds in figures.items()}))


if __name__ == "__main__":
    app()
