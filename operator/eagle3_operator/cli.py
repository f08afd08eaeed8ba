"""`eagle3-operator`: run the kopf operator with the project's settings, a liveness endpoint and metrics.

High availability is one replica with a Recreate strategy (the Helm chart's default) plus `--standalone`:
kopf's peering is not leader election (operators of equal priority both pause), and a restarted operator
converges on its own because every pass is level-based. `--peering NAME` is there for clusters that run a
second, lower-priority standby; it needs the kopf peering CRD and RBAC for it.

Exact `--namespace` names are served as given, without watching Namespace objects (kopf's scanning is off,
so no cluster-wide reads are needed and the Eagle3Target CRD must exist before the operator starts). A
glob (`team-*`) makes kopf watch Namespaces, and kopf misses a matching namespace created while that watch
(re)lists, until the namespace changes or the operator restarts.
"""

import logging
from typing import Annotated

import kopf
import prometheus_client
import typer

from eagle3_operator import handlers
from eagle3_operator.settings import OperatorConfig, needs_cluster_scanning

app = typer.Typer(add_completion=False)


@app.command()
def run(
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace",
            "-n",
            help="namespace to serve (repeatable); a glob (team-*) makes kopf watch Namespaces, and a"
            " matching namespace created while that watch re-lists goes unserved until it changes",
        ),
    ] = None,
    all_namespaces: Annotated[
        bool, typer.Option("--all-namespaces", "-A", help="serve every namespace (cluster-wide)")
    ] = False,
    liveness: Annotated[
        str, typer.Option(help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz; empty disables")
    ] = "http://0.0.0.0:8080/healthz",
    metrics_port: Annotated[int, typer.Option(help="port of /metrics (Prometheus); 0 disables")] = 8081,
    metrics_address: Annotated[str, typer.Option(help="address /metrics binds to")] = "0.0.0.0",
    standalone: Annotated[
        bool, typer.Option("--standalone/--peering-auto", help="never pause for peers (single replica)")
    ] = True,
    peering: Annotated[
        str | None, typer.Option(help="join this kopf peering object (implies --peering-auto)")
    ] = None,
    reprobe_seconds: Annotated[
        float, typer.Option(min=0.2, help="how often target servers are re-probed")
    ] = OperatorConfig.reprobe_seconds,
    api_timeout_seconds: Annotated[
        float, typer.Option(min=1, help="timeout of one Kubernetes API request")
    ] = OperatorConfig.api_timeout_seconds,
    operator_namespace: Annotated[
        str | None,
        typer.Option(
            envvar="POD_NAMESPACE",
            help="the namespace this operator runs in, admitted to targets' data port by their NetworkPolicy",
        ),
    ] = None,
    prometheus_namespace: Annotated[
        str | None,
        typer.Option(help="the namespace Prometheus runs in, admitted to targets' metrics port"),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    """Reconcile Eagle3Target resources into target-server Deployments and publish their status."""
    if bool(namespace) == all_namespaces:
        raise typer.BadParameter("pass --namespace (repeatable) or --all-namespaces, exactly one of them")
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    if not verbose:  # One line per handler call and per probe request would drown the real news.
        for noisy in ("kopf.objects", "httpx", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if metrics_port:
        prometheus_client.start_http_server(metrics_port, addr=metrics_address)
    config = operator_config(
        namespace or [],
        all_namespaces,
        reprobe_seconds,
        api_timeout_seconds,
        operator_namespace=operator_namespace,
        prometheus_namespace=prometheus_namespace,
    )
    kopf.run(
        registry=handlers.registry,
        clusterwide=all_namespaces,
        namespaces=namespace or (),
        standalone=standalone and peering is None,
        peering_name=peering,
        liveness_endpoint=liveness or None,
        memo=kopf.Memo(config=config),
    )


def operator_config(
    namespaces: list[str],
    all_namespaces: bool,
    reprobe_seconds: float,
    api_timeout_seconds: float,
    *,
    operator_namespace: str | None = None,
    prometheus_namespace: str | None = None,
) -> OperatorConfig:
    """The config for this scope: exact namespaces turn kopf's Namespace and CRD watches off."""
    return OperatorConfig(
        reprobe_seconds=reprobe_seconds,
        api_timeout_seconds=api_timeout_seconds,
        scan_cluster=needs_cluster_scanning(namespaces, all_namespaces),
        operator_namespace=operator_namespace,
        prometheus_namespace=prometheus_namespace,
    )


def main() -> None:
    app()
