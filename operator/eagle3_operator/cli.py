"""`eagle3-operator`: run the kopf operator with the project's settings, a liveness endpoint and metrics.

At startup the operator reads the installed Eagle3Target CRD's schema version, says which it found, and
refuses to start on a CRD older than it needs.

High availability: with `--leader-elect`, any number of replicas compete for a coordination.k8s.io Lease
(leader.py). Every replica runs kopf, so a standby's indexes are listed and kept warm, but only the holder
reconciles (and probes); a standby takes over within about 20 s of the leader dying, or at once when it
stops cleanly, and acts within seconds of winning. A leader that cannot renew exits.
kopf's own peering is not used: it is not leader election (operators of equal priority both pause).

Exact `--namespace` names and `--all-namespaces` need no Namespace or CRD watches (kopf's scanning is off,
so the Eagle3Target CRD must exist before the operator starts, which the startup check ensures). A glob
(`team-*`) makes kopf watch Namespaces, and kopf misses a matching namespace created while that watch
(re)lists, until the namespace changes or the operator restarts.
"""

import asyncio
import logging
import os
import secrets
import socket
from typing import Annotated, Any

import kopf
import prometheus_client
import typer
import uvloop

from eagle3_operator import handlers
from eagle3_operator.constants import CRD_SCHEMA_VERSION
from eagle3_operator.kube import KubeApi
from eagle3_operator.leader import LeaderElector
from eagle3_operator.readiness import Readiness
from eagle3_operator.render.network import Neighbours
from eagle3_operator.render.server_image import DEFAULT_IMAGE, ServerImages, release_image
from eagle3_operator.settings import OperatorConfig, needs_cluster_scanning, parse_labels

logger = logging.getLogger(__name__)


class CrdMismatch(Exception):
    """The installed CRD cannot be served by this operator."""


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
            show_default="none: pass it or --all-namespaces",
        ),
    ] = None,
    all_namespaces: Annotated[
        bool,
        typer.Option(
            "--all-namespaces", "-A", help="serve every namespace (cluster-wide)", show_default="off"
        ),
    ] = False,
    liveness: Annotated[
        str, typer.Option(help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz; empty disables")
    ] = "http://0.0.0.0:8080/healthz",
    readiness: Annotated[
        str,
        typer.Option(
            help="readiness endpoint (readiness.py), e.g. http://0.0.0.0:8082/readyz",
            show_default="empty: none",
        ),
    ] = "",
    metrics_port: Annotated[int, typer.Option(help="port of /metrics (Prometheus); 0 disables")] = 8081,
    metrics_address: Annotated[str, typer.Option(help="address /metrics binds to")] = "0.0.0.0",
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
            show_default="none: not admitted",
        ),
    ] = None,
    prometheus_namespace: Annotated[
        str | None,
        typer.Option(
            help="the namespace Prometheus runs in, admitted to targets' metrics port by their NetworkPolicy",
            show_default="none: not admitted, so Prometheus cannot scrape a target with spec.networkPolicy",
        ),
    ] = None,
    pod_monitor_label: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY=VALUE",
            help="label on every PodMonitor the operator renders (repeatable), e.g."
            " release=kube-prometheus-stack for a Prometheus that selects PodMonitors by it; a target's"
            " spec.monitoring.podMonitor.labels win on the same key",
            show_default="none",
        ),
    ] = None,
    server_image: Annotated[
        str,
        typer.Option(
            help="server image for new targets without spec.image (existing targets keep theirs until"
            " annotated eagle3.dev/upgrade-server-image)"
        ),
    ] = DEFAULT_IMAGE,
    sglang_server_image: Annotated[
        str, typer.Option(help="server image for new targets with engine sglang (SGLang's variant)")
    ] = release_image("sglang"),
    leader_elect: Annotated[
        bool, typer.Option(help="act only while holding a coordination.k8s.io Lease (run several replicas)")
    ] = False,
    leader_election_namespace: Annotated[
        str | None,
        typer.Option(help="namespace of the Lease", show_default="--operator-namespace, else default"),
    ] = None,
    leader_election_name: Annotated[str, typer.Option(help="name of the Lease")] = "eagle3-operator",
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="debug logging", show_default="off")
    ] = False,
) -> None:
    """Reconcile Eagle3Target resources into target-server Deployments and publish their status."""
    if bool(namespace) == all_namespaces:
        raise typer.BadParameter("pass --namespace (repeatable) or --all-namespaces, exactly one of them")
    try:
        monitor_labels = parse_labels(pod_monitor_label or [])
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--pod-monitor-label") from None
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    if not verbose:  # One line per handler call and per probe request would drown the real news.
        for noisy in ("kopf.objects", "httpx", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if metrics_port:
        prometheus_client.start_http_server(metrics_port, addr=metrics_address)
    config = OperatorConfig(
        reprobe_seconds=reprobe_seconds,
        api_timeout_seconds=api_timeout_seconds,
        scan_cluster=needs_cluster_scanning(namespace or []),
        server_images=ServerImages(default=server_image, sglang=sglang_server_image),
        neighbours=Neighbours(operator_namespace, prometheus_namespace, monitor_labels),
    )
    lease_namespace = leader_election_namespace or operator_namespace or "default"
    election = (lease_namespace, leader_election_name) if leader_elect else None
    kopf_options = {
        "registry": handlers.registry,
        "clusterwide": all_namespaces,
        "namespaces": namespace or (),
        "standalone": True,  # kopf's peering would pause equal peers; leadership is the Lease's
        "liveness_endpoint": liveness or None,
        "memo": kopf.Memo(config=config),
    }
    try:
        # uvloop, as `kopf run` would pick it: the probes and watches of hundreds of targets share this loop.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(operate(config, kopf_options, election, readiness))
    except CrdMismatch as error:
        typer.echo(f"eagle3-operator: {error}", err=True)
        raise typer.Exit(2) from error


async def operate(
    config: OperatorConfig,
    kopf_options: dict[str, Any],
    election: tuple[str, str] | None,
    readiness_url: str = "",
) -> None:
    """Check the CRD, then run kopf (until a signal, or a lost lease); when electing, kopf's indexes fill
    while this replica stands by, and its passes start when it wins the Lease."""
    api = await KubeApi.connect(config.api_timeout_seconds)
    try:
        async with Readiness().serving(readiness_url) as readiness:
            await check_crd(api)
            kopf_options = {**kopf_options, "ready_flag": readiness.kopf_started}
            if election is None:
                readiness.leading = True
                await kopf.operator(**kopf_options)
                return
            identity = f"{socket.gethostname()}-{secrets.token_hex(3)}"
            elector = LeaderElector(api, *election, identity)
            leading = kopf_options["memo"].leading = asyncio.Event()
            readiness.standby = True

            def lead() -> None:
                readiness.standby, readiness.leading = False, True
                leading.set()

            # Created before kopf starts: kopf waits for, then cancels, tasks started after it, at its stop.
            electing = asyncio.create_task(elector.run(lead, _exit_at_once), name="leader election")
            try:
                await kopf.operator(**kopf_options)
            finally:  # a signal: renewing stops, then the Lease is released (a standby leads at once)
                electing.cancel()
                await asyncio.wait([electing])
    finally:
        await api.close()


async def check_crd(api: KubeApi) -> int:
    """Say which CRD schema version is installed; refuse one older than this operator needs."""
    found = await api.crd_schema_version()
    if found is None:
        raise CrdMismatch("the Eagle3Target CRD is not installed: kubectl apply --server-side -f crds/")
    if found < CRD_SCHEMA_VERSION:
        raise CrdMismatch(
            f"the installed Eagle3Target CRD has schema version {found}, this operator needs"
            f" {CRD_SCHEMA_VERSION}: upgrade the CRD first (kubectl apply --server-side -f crds/, or the"
            " chart's crds/ directory)"
        )
    newer = " (newer: fields this operator does not know are ignored)" if found > CRD_SCHEMA_VERSION else ""
    logger.info("Eagle3Target CRD schema version %d found%s", found, newer)
    return found


def _exit_at_once() -> None:
    """Leadership lost (or unknowable after an error): stop acting now, before another replica may start
    (the pod restarts as a standby)."""
    logging.shutdown()
    os._exit(1)


def main() -> None:
    app()
