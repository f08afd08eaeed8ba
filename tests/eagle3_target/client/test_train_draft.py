"""examples/train_draft.py learns: a fresh draft's loss drops over 200 steps against a served tiny target."""

from __future__ import annotations

import typer
from eagle3_target.client import TargetClient
from typer.testing import CliRunner

from examples.train_draft import main, train
from support.server_process import AUTH_TOKEN


def mean(history: list[dict[str, float]], key: str) -> float:
    return sum(h[key] for h in history) / len(history)


def test_draft_loss_drops_over_200_steps(llama_server):
    with TargetClient(llama_server.url, token=AUTH_TOKEN) as client:
        history = train(client, steps=200, progress=False)
    assert [h["step"] for h in history] == list(range(200))
    first, last = history[:20], history[-20:]
    # The soft cross-entropy cannot fall below the target's own entropy (about 4.5 nats on this random
    # model), so the learnable part is a few tenths: require most of it.
    assert mean(last, "loss") < mean(first, "loss") - 0.1, (mean(first, "loss"), mean(last, "loss"))
    assert mean(last, "acc") > mean(first, "acc") + 0.2


def test_command_line_trains_against_a_url(llama_server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(AUTH_TOKEN + "\n")
    app = typer.Typer()
    app.command()(main)
    args = ["--url", llama_server.url, "--token-file", str(token_file), "--steps", "6", "--format", "draft"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "first 3 steps: loss" in result.output
    assert "last 3 steps: loss" in result.output
    refused = CliRunner().invoke(app, ["--steps", "6"])
    assert refused.exit_code != 0
    assert "exactly one of --target or --url" in refused.output
