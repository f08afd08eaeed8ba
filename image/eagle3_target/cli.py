"""The `eagle3-target` command line. Commands stay thin: they parse flags and call into the package,
importing heavy modules (torch, transformers) only when the command runs."""

from __future__ import annotations

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


app.command("serve")(serve)
app.command("resolve")(resolve_command)
app.add_typer(export_app, name="export")


def main() -> None:
    app()
