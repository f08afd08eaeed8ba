"""`eagle3-target export speculators|specforge`: a served target's supervision as trainer feature files."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from eagle3_target.integrations.connect import Connection

if TYPE_CHECKING:
    from eagle3_target.integrations.layouts import Layout

export_app = typer.Typer(
    help="Write a trainer's offline feature files from a served target (resumable).", no_args_is_help=True
)

DataOption = Annotated[
    Path,
    typer.Option(
        "--data", help="pre-tokenised JSONL (input_ids, loss_mask per line; row i -> file i)", exists=True
    ),
]
OutOption = Annotated[Path, typer.Option("--out", help="output directory (rerun to resume)")]
BatchTokensOption = Annotated[
    int | None,
    typer.Option(min=1, help="tokens per request; default (and cap): the server's max_batch_tokens"),
]
DepthOption = Annotated[int, typer.Option(min=1, help="requests in flight while files are written")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")]


def connection_options(
    target: Annotated[
        str | None, typer.Option("--target", help="Eagle3Target name (resolved by name).")
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option(
            "--namespace", "-n", help="the target's namespace; default: the kubeconfig's (or the pod's)"
        ),
    ] = None,
    url: Annotated[
        list[str] | None,
        typer.Option("--url", help="target server URL instead of a name (repeat for fail-over)"),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="file holding the target's bearer token, read again when it answers 401 (default: none "
            "sent)",
        ),
    ] = None,
    wait: Annotated[
        float,
        typer.Option(
            min=0,
            help="seconds to wait for a named target to be Available (some endpoint serves its current "
            "model), waking it if idle",
        ),
    ] = 300.0,
    kubeconfig: Annotated[str | None, typer.Option(envvar="KUBECONFIG", help="kubeconfig file")] = None,
) -> Connection:
    """The options every export command takes to find its target, as one `Connection`."""
    return Connection(
        target=target,
        urls=tuple(url or ()),
        namespace=namespace,
        token_file=token_file,
        wait=wait,
        kubeconfig=kubeconfig,
    )


def with_connection(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with its `connection: Connection` parameter shown on the command line as the options of
    `connection_options` (in its place), and called with the `Connection` they build."""
    shared = inspect.signature(connection_options, eval_str=True).parameters
    signature = inspect.signature(command, eval_str=True)
    own = list(signature.parameters.values())
    at = [p.name for p in own].index("connection")

    @functools.wraps(command)
    def wrapper(**options: Any) -> None:
        connection = connection_options(**{name: options.pop(name) for name in shared})
        command(connection=connection, **options)

    # typer reads the options from the signature; a function declares no __signature__ for mypy to know.
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*own[:at], *shared.values(), *own[at + 1 :]]
    )
    return wrapper


def _run(
    make_layout: Callable[[], Layout],
    data: Path,
    out: Path,
    connection: Connection,
    batch_tokens: int | None,
    depth: int,
    quiet: bool,
) -> None:
    """Build the layout, connect, export; every expected failure is one `error:` line and exit code 1."""
    from eagle3_target.client.errors import ClientError
    from eagle3_target.integrations.exporter import ExportError, export
    from eagle3_target.integrations.layouts import LayoutMismatch
    from eagle3_target.integrations.rows import RowError, open_rows

    try:
        layout = make_layout()
        source = open_rows(data)
        with connection.open() as client:
            summary = export(
                client, source, layout, out, batch_tokens=batch_tokens, depth=depth, progress=not quiet
            )
    except (ExportError, RowError, LayoutMismatch, ClientError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(summary.describe(), err=True)


@export_app.command("speculators")
@with_connection
def speculators(
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="pre-tokenised JSONL (input_ids, loss_mask per line) or a speculators prepare-data "
            "directory; row i -> hidden_states/hs_{i}.safetensors",
            exists=True,
        ),
    ],
    out: OutOption,
    connection: Connection,
    method: Annotated[
        str | None,
        typer.Option(
            help="the draft method whose default layers to write: eagle3, peagle, dflash, dspark, mtp "
            "(default: the target's aux layers, as EAGLE-3)"
        ),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(
            help="the draft's layers instead, as target layer ids (vLLM ids - 1), e.g. 1,5,9; or none"
        ),
    ] = None,
    final: Annotated[
        str | None,
        typer.Option(
            help="the last state the files end with: prenorm, the only choice (speculators normalises it "
            "itself); default: prenorm"
        ),
    ] = None,
    batch_tokens: BatchTokensOption = None,
    depth: DepthOption = 2,
    quiet: QuietOption = False,
) -> None:
    """speculators' offline hidden states (what `speculators generate-offline-data` writes from vLLM):
    OUT/hidden_states/hs_{i}.safetensors, [S, k+1, H]: the draft's layers, then h_L before the final norm.
    Default: the target's aux layers (EAGLE-3). Train with --data-path on the prepare-data directory,
    --hidden-states-path OUT/hidden_states and --target-layer-ids the layers + 1."""
    from eagle3_target.integrations.layouts import SpeculatorsLayout
    from eagle3_target.protocol import parse_layer_ids

    def layout() -> SpeculatorsLayout:
        if final is not None and layers is None and method is None:
            raise ValueError("--final needs --layers (or --method)")
        layer_ids = None if layers is None else list(parse_layer_ids(layers))
        return SpeculatorsLayout(layer_ids, method=method, final=final)

    _run(layout, data, out, connection, batch_tokens, depth, quiet)


@export_app.command("specforge")
@with_connection
def specforge(
    data: DataOption,
    out: OutOption,
    connection: Connection,
    aux_layer_ids: Annotated[
        tuple[int, int, int] | None,
        typer.Option(
            help="the aux layers SpecForge's run sets (model.aux_hidden_state_layer_ids); default: the draft "
            "config's, else [1, L//2-1, L-4]"
        ),
    ] = None,
    draft_config: Annotated[
        Path | None,
        typer.Option(help="SpecForge's draft config JSON, for its eagle_config aux layer ids", exists=True),
    ] = None,
    batch_tokens: BatchTokensOption = None,
    depth: DepthOption = 2,
    quiet: QuietOption = False,
) -> None:
    """SpecForge's offline features (specforge_hidden_states_v1, what its prepare_hidden_states.py writes):
    OUT/rows_{g}-{g+2000}/data_{i}.ckpt. Train with data.hidden_states_path: OUT. Needs a bf16 target
    whose aux layers are the ones SpecForge assumes (checked)."""
    from eagle3_target.integrations.layouts import SpecForgeLayout

    _run(
        lambda: SpecForgeLayout(aux_layer_ids, draft_config),
        data,
        out,
        connection,
        batch_tokens,
        depth,
        quiet,
    )
