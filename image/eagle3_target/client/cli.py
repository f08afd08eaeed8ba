"""`eagle3-target resolve`: print where a named target is served, for scripts and humans."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated

import typer


class Output(StrEnum):
    json = "json"
    urls = "urls"


class Requirement(StrEnum):
    """resolve's `require` (client.resolve.Requirement), as the CLI's choice."""

    available = "Available"
    ready = "Ready"


def resolve_command(
    name: Annotated[str, typer.Argument(help="Eagle3Target name")],
    namespace: Annotated[
        str | None,
        typer.Option("--namespace", "-n", help="default: the kubeconfig's (or the pod's) namespace"),
    ] = None,
    wait: Annotated[
        float,
        typer.Option(
            min=0,
            help="seconds to wait until the target meets --require; 0 checks once (Python's resolve() "
            "waits 300 by default)",
        ),
    ] = 0.0,
    require: Annotated[
        Requirement,
        typer.Option(
            help="Available: some endpoint serves the current model (its serving endpoints are returned);"
            " Ready: every desired replica does"
        ),
    ] = Requirement.available,
    output: Annotated[
        Output, typer.Option("--output", "-o", help="json, or urls (one per line)")
    ] = Output.json,
    kubeconfig: Annotated[str | None, typer.Option(envvar="KUBECONFIG", help="kubeconfig file")] = None,
    wake: Annotated[
        bool, typer.Option("--wake/--no-wake", help="wake the target if it is idle (needs patch on it)")
    ] = True,
) -> None:
    """Resolve an Eagle3Target: its URL, serving endpoints, model and fingerprint, once it serves."""
    from eagle3_target.client import ClientError, resolve

    try:
        target = resolve(name, namespace, wait, kubeconfig=kubeconfig, require=require.value, wake=wake)
    except ClientError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if output is Output.urls:
        typer.echo("\n".join(target.urls))
    else:
        typer.echo(json.dumps(target.to_dict(), indent=2))
