"""examples/train_draft.py learns: a fresh draft's loss drops over 200 steps against a served tiny target."""

from __future__ import annotations

from eagle3_target.client import TargetClient

from examples.train_draft import train
from tests.eagle3_target.client.helpers import TOKEN


def mean(history: list[dict[str, float]], key: str) -> float:
    return sum(h[key] for h in history) / len(history)


def test_draft_loss_drops_over_200_steps(llama_server):
    with TargetClient(llama_server.url, token=TOKEN) as client:
        history = train(client, steps=200, progress=False)
    assert [h["step"] for h in history] == list(range(200))
    first, last = history[:20], history[-20:]
    # The soft cross-entropy cannot fall below the target's own entropy (about 4.5 nats on this random
    # model), so the learnable part is a few tenths: require most of it.
    assert mean(last, "loss") < mean(first, "loss") - 0.1, (mean(first, "loss"), mean(last, "loss"))
    assert mean(last, "acc") > mean(first, "acc") + 0.2
