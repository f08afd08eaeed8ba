"""The `eagle3-target` command line. Commands stay thin: they parse flags and call into the package,
importing heavy modules (torch, transformers) only when the command runs."""

from __future__ import annotations

import contextlib
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from eagle3_target.client.cli import resolve_command
from eagle3_target.integrations.cli import export_app
from eagle3_target.server.cli import serve

app = typer.Typer(help="Serve frozen target LLMs for EAGLE-3 draft training.", no_args_is_help=True)


@app.callback()
def _root() -> None:
    """Subcommands only: a callback keeps typer from collapsing a one-command app into that command."""


class Arch(StrEnum):
    llama = "llama"
    qwen3 = "qwen3"


@app.command("tiny-model")
def tiny_model(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the model into")],
    arch: Annotated[
        Arch, typer.Option(help="llama (untied lm_head) or qwen3 (tied embeddings)")
    ] = Arch.llama,
    layers: Annotated[int, typer.Option(min=1, help="decoder layers")] = 8,
    hidden: Annotated[int, typer.Option(min=8, help="hidden size (a multiple of 8)")] = 64,
    vocab: Annotated[int, typer.Option(min=2, help="vocabulary size")] = 256,
    seed: Annotated[int, typer.Option(help="random seed for the weights")] = 0,
) -> None:
    """Write a tiny random-weight causal LM (for tests and demos; no hub download)."""
    from eagle3_target.tiny import write_tiny_model

    try:
        path = write_tiny_model(
            out_dir, arch=arch.value, num_layers=layers, hidden_size=hidden, vocab_size=vocab, seed=seed
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(str(path))


@app.command()
def hydrate(
    repo: Annotated[str, typer.Option(help="Hugging Face repository id, e.g. org/model")],
    local_dir: Annotated[Path, typer.Option(help="directory the snapshot goes to (in the cache volume)")],
    revision: Annotated[str, typer.Option(help="branch, tag or commit")] = "main",
    exclude: Annotated[list[str] | None, typer.Option(help="glob of files to skip (repeatable)")] = None,
    progress_port: Annotated[int, typer.Option(help="serve progress JSON on this port (0: off)")] = 0,
    termination_log: Annotated[
        Path, typer.Option(help="where the failure reason goes (Kubernetes shows it in the pod status)")
    ] = Path("/dev/termination-log"),
) -> None:
    """Download a model snapshot once and mark it complete (the operator's hydration Job runs this)."""
    from eagle3_target.hydrate import HydrationFailed, ProgressTracker, serve_progress
    from eagle3_target.hydrate import hydrate as run_hydration

    tracker = ProgressTracker(local_dir)
    server = serve_progress(tracker, progress_port) if progress_port else None
    try:
        marker = run_hydration(repo, revision, local_dir, excludes=exclude or [], tracker=tracker)
    except HydrationFailed as failure:
        typer.echo(str(failure), err=True)
        with contextlib.suppress(OSError):  # outside Kubernetes there may be none; stderr has the reason
            termination_log.write_text(str(failure))
        raise typer.Exit(failure.exit_code) from None
    finally:
        if server is not None:
            server.shutdown()
    typer.echo(f"{repo}@{revision}: {marker['files']} files, {marker['bytes']} bytes in {local_dir}")


@app.command("wait-for-model")
def wait_for_model(
    local_dir: Annotated[Path, typer.Option(help="the snapshot directory `hydrate` fills")],
    poll_seconds: Annotated[float, typer.Option(min=0.1, help="how often to look")] = 5.0,
) -> None:
    """Return once `hydrate` has marked the snapshot complete (the server pods' init container runs this)."""
    from eagle3_target.hydrate import wait_until_hydrated

    wait_until_hydrated(local_dir, poll_seconds, lambda line: typer.echo(line, err=True))
    typer.echo(f"{local_dir} is complete")


app.command("serve")(serve)
app.command("resolve")(resolve_command)
app.add_typer(export_app, name="export")


def main() -> None:
    app()


if __name__ == "__main__":  # `python -m eagle3_target.cli`, where the console script is not installed
    main()
