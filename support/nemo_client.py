"""NeMo AutoModel's remote-target protocol, played as its client does: one keep-alive session per server,
NeMo's wire format, ``/set_vocab_mapping`` then ``/generate``; and the batch NeMo would build co-located
(``contract.build_batch`` with the mapping) to compare the answers with. Shared by the server's tests on
the HF engine and on real vLLM."""

from __future__ import annotations

import httpx
import torch
from eagle3_target.contract import VocabMapping, build_batch
from eagle3_target.runners import TargetRunner
from eagle3_target.wire import nemo as nemo_wire
from torch import Tensor

SUPERVISION_KEYS = ["aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask"]


def nemo_session() -> httpx.Client:
    """Like NeMo's requests.Session: one pooled keep-alive connection, no client id."""
    return httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1), trust_env=False)


def set_mapping(session: httpx.Client, url: str, mapping: VocabMapping) -> httpx.Response:
    payload = nemo_wire.encode(
        {"selected_token_ids": mapping.selected_token_ids, "selected_token_mask": mapping.selected_token_mask}
    )
    return session.post(
        url + "/set_vocab_mapping", content=payload, headers={"Content-Type": "application/octet-stream"}
    )


def generate(session: httpx.Client, url: str, ids: Tensor, mask: Tensor, loss_mask: Tensor) -> httpx.Response:
    payload = nemo_wire.encode({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask})
    return session.post(
        url + "/generate", content=payload, headers={"Content-Type": "application/octet-stream"}
    )


def nemo_reference(
    runner: TargetRunner, ids: Tensor, mask: Tensor, loss_mask: Tensor, mapping: VocabMapping
) -> dict[str, Tensor]:
    logits, aux = runner.forward_eagle3(ids, mask)
    batch = build_batch(logits, aux, ids, mask, loss_mask, mapping=mapping)
    return {name: getattr(batch, name) for name in SUPERVISION_KEYS}


def loss_mask_for(mask: Tensor) -> Tensor:
    loss_mask = mask.clone()
    loss_mask[:, :3] = 0  # the prompt is not supervised
    return loss_mask


def assert_generate_matches(response: httpx.Response, want: dict[str, Tensor], atol: float = 0.0) -> None:
    """The answer is NeMo's batch, in NeMo's order: equal to `want`, or within `atol` (another engine)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    got = nemo_wire.decode(response.content)
    assert list(got) == SUPERVISION_KEYS  # NeMo's order
    for name in SUPERVISION_KEYS:
        tensor = got[name]
        assert tensor is not None and tensor.dtype == want[name].dtype, name
        torch.testing.assert_close(tensor, want[name], atol=atol, rtol=atol, msg=f"{name} differs")
