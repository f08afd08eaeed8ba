"""Train a small EAGLE-3-style draft model against a served target, resolved by name or given by URL.

    python examples/train_draft.py --target llama31-8b -n ml-training --token-file TOKEN --device cuda
    python examples/train_draft.py --url http://127.0.0.1:8000 --steps 200

By name (--target), the client reads the target's endpoints from its status, follows them as pods come and
go, and wakes the target if it is idle; a URL is fixed. examples/llama-3.1-8b/train-job.yaml runs this in the
cluster.

The draft follows EAGLE-3's shape: `fc` fuses the target's three captured layers into one feature, one Llama
decoder layer reads [token embedding ; feature], a head predicts over the draft vocabulary, and a few
"training-time test" steps are unrolled, each feeding the draft its own previous output. The attention is
simply causal per step (no tree attention over earlier steps' keys), enough to show the data path end to end.
The text is synthetic: Zipf-distributed token ids, unpadded, with the first tokens of each row as the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import typer
from eagle3_target.client import TargetClient
from eagle3_target.contract import Eagle3TargetBatch, VocabMapping, shift_left
from torch import Tensor, nn
from tqdm import tqdm
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

TTT_DECAY = 0.8  # EAGLE-3's weight of unrolled step i is 0.8**i
PROMPT_TOKENS = 4  # loss_mask is 0 on these, as on a chat prompt


class Eagle3Draft(nn.Module):
    """fc(3H -> H), one decoder layer over [embedding ; feature] (2H -> H), a draft-vocab head."""

    def __init__(self, embeddings: Tensor, draft_vocab_size: int, num_heads: int = 4) -> None:
        super().__init__()
        hidden = embeddings.shape[1]
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            vocab_size=embeddings.shape[0],
            attn_implementation="sdpa",
        )
        self.embed = nn.Embedding.from_pretrained(embeddings.float(), freeze=True)  # the target's, frozen
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.head = nn.Linear(hidden, draft_vocab_size, bias=False)

    def step(self, input_ids: Tensor, feature: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step: (its hidden state, fed back as the next step's feature; draft-vocab logits)."""
        x = self.fuse(torch.cat((self.embed(input_ids), feature), dim=-1))
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        # attention_mask=None makes the layer's SDPA attention causal; the rows carry no padding.
        hidden = self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return hidden, self.head(self.norm(hidden))


def ttt_loss(draft: Eagle3Draft, batch: Eagle3TargetBatch, ttt_steps: int) -> tuple[Tensor, Tensor]:
    """Soft cross-entropy vs the target's draft-vocab distribution over unrolled steps; and step-0 top-1 acc.

    Each step moves one token further: the ids, the target distribution and its mask shift left once more.
    """
    assert batch.target_probs is not None and batch.position_mask is not None  # built with a draft vocab
    ids, probs, mask = batch.input_ids, batch.target_probs, batch.position_mask.squeeze(-1)
    feature = draft.fc(batch.aux_hidden_states.float())
    device = feature.device
    total, weights, accuracy = torch.zeros((), device=device), 0.0, torch.zeros((), device=device)
    for i in range(ttt_steps):
        feature, logits = draft.step(ids, feature)
        supervised = mask.float()
        per_position = -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        total = total + TTT_DECAY**i * (per_position * supervised).sum() / supervised.sum().clamp(min=1)
        weights += TTT_DECAY**i
        if i == 0:
            hits = (logits.argmax(-1) == probs.argmax(-1)) & mask
            accuracy = hits.sum() / mask.sum().clamp(min=1)
        ids, probs, mask = shift_left(ids), shift_left(probs), shift_left(mask)
    return total / weights, accuracy


@dataclass(frozen=True)
class SyntheticText:
    """A fixed corpus of Zipf-distributed token rows; epochs cycle over it in a seeded order."""

    input_ids: Tensor  # [N, S]

    @classmethod
    def generate(cls, vocab_size: int, rows: int, seq_len: int, seed: int) -> SyntheticText:
        g = torch.Generator().manual_seed(seed)
        ranks = torch.randperm(vocab_size, generator=g)
        zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
        draws = torch.multinomial(zipf, rows * seq_len, replacement=True, generator=g)
        return cls(ranks[draws].reshape(rows, seq_len))

    def loss_mask(self, rows: Tensor) -> Tensor:
        mask = torch.ones_like(rows)
        mask[:, :PROMPT_TOKENS] = 0
        return mask

    def draft_vocab(self, vocab_size: int, draft_vocab_size: int) -> VocabMapping:
        """The most frequent supervised tokens (EAGLE's recipe), most frequent first."""
        supervised = self.input_ids[self.loss_mask(self.input_ids).bool()]
        counts = torch.bincount(supervised, minlength=vocab_size)
        order = torch.argsort(counts, descending=True, stable=True)
        return VocabMapping.from_selected_ids(order[:draft_vocab_size], vocab_size)

    def batches(self, batch_size: int, steps: int, seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
        g = torch.Generator().manual_seed(seed)
        out: list[tuple[Tensor, Tensor, Tensor]] = []
        order = torch.randperm(len(self.input_ids), generator=g)
        while len(out) < steps:
            for start in range(0, len(order) - batch_size + 1, batch_size):
                rows = self.input_ids[order[start : start + batch_size]]
                out.append((rows, torch.ones_like(rows), self.loss_mask(rows)))
            order = torch.randperm(len(self.input_ids), generator=g)
        return out[:steps]


@dataclass
class DraftRun:
    """A fresh draft with its optimizer, and the corpus and draft vocabulary it trains on, all seeded."""

    text: SyntheticText
    mapping: VocabMapping
    draft: Eagle3Draft
    optimizer: torch.optim.Optimizer

    @classmethod
    def start(
        cls,
        vocab_size: int,
        embeddings: Tensor,
        *,
        seq_len: int = 32,
        corpus_rows: int = 32,
        draft_vocab_size: int | None = None,
        lr: float = 3e-3,
        seed: int = 0,
    ) -> DraftRun:
        """`embeddings` are the target's input embeddings [V, H] (frozen in the draft); the draft trains on
        their device."""
        torch.manual_seed(seed)
        text = SyntheticText.generate(vocab_size, corpus_rows, seq_len, seed)
        mapping = text.draft_vocab(vocab_size, draft_vocab_size or vocab_size // 2).to(embeddings.device)
        draft = Eagle3Draft(embeddings, mapping.draft_vocab_size).to(embeddings.device)
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
        return cls(text, mapping, draft, optimizer)

    def step(self, batch: Eagle3TargetBatch, ttt_steps: int) -> dict[str, float]:
        """One optimizer step on one batch of target supervision; its {loss, acc} (acc = step-0 top-1)."""
        loss, accuracy = ttt_loss(self.draft, batch, ttt_steps)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item(), "acc": accuracy.item()}


def train(
    client: TargetClient,
    *,
    steps: int = 200,
    batch_size: int = 4,
    seq_len: int = 32,
    corpus_rows: int = 32,
    draft_vocab_size: int | None = None,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    format: str = "hidden",
    prefetch_depth: int = 2,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Train a fresh draft for `steps` batches; returns the history [{step, loss, acc}] (acc = top-1)."""
    run = DraftRun.start(
        client.info().vocab_size,
        client.weight("input_embeddings"),
        seq_len=seq_len,
        corpus_rows=corpus_rows,
        draft_vocab_size=draft_vocab_size,
        lr=lr,
        seed=seed,
    )
    history: list[dict[str, float]] = []
    batches = client.prefetch(
        run.text.batches(batch_size, steps, seed), format=format, mapping=run.mapping, depth=prefetch_depth
    )
    with tqdm(batches, total=steps, disable=not progress, desc="draft") as bar:
        for step, batch in enumerate(bar):
            metrics = run.step(batch, ttt_steps)
            history.append({"step": step, **metrics})
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.2f}")
    return history


def main(
    target: Annotated[str | None, typer.Option(help="Eagle3Target name to resolve.")] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n")] = None,
    url: Annotated[
        list[str] | None, typer.Option(help="Target server URL (repeatable) instead of --target.")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(help="Bearer token file (the target's spec.auth Secret); read again if it is rotated."),
    ] = None,
    device: Annotated[
        str, typer.Option(help="Where the draft trains and the client applies the target's LM head.")
    ] = "cpu",
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for --target to serve (a first download and load).")
    ] = 300.0,
    steps: int = 200,
    batch_size: int = 4,
    seq_len: int = 32,
    ttt_steps: int = 3,
    draft_vocab_size: int | None = None,
    lr: float = 3e-3,
    format: Annotated[
        str, typer.Option(help="Supervision format: hidden, draft, probs or logits.")
    ] = "hidden",
    seed: int = 0,
) -> None:
    """Train a draft and print its loss and top-1 accuracy at the start and the end."""
    if (target is None) == (not url):
        raise typer.BadParameter("give exactly one of --target or --url")
    endpoints: str | list[str] = target if target is not None else (url or [])
    with TargetClient(
        endpoints, namespace=namespace, wait=wait, token_file=token_file, device=device
    ) as client:
        history = train(
            client,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            ttt_steps=ttt_steps,
            draft_vocab_size=draft_vocab_size,
            lr=lr,
            format=format,
            seed=seed,
        )
    window = max(1, min(20, len(history) // 2))
    for label, part in (("first", history[:window]), ("last", history[-window:])):
        loss = sum(h["loss"] for h in part) / len(part)
        acc = sum(h["acc"] for h in part) / len(part)
        print(f"{label} {window} steps: loss {loss:.4f}, top-1 accuracy {acc:.3f}")


if __name__ == "__main__":
    typer.run(main)
