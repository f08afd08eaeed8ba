"""Request builders and reference computations shared by the server tests."""

from __future__ import annotations

import httpx
import torch
from eagle3_target import formats
from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import FORMATS
from eagle3_target.runners import TargetRunner
from eagle3_target.wire import tensors as tensor_wire
from torch import Tensor

VOCAB = 256


def token_batch(batch: int, seq: int, seed: int, pad_last: int = 0) -> tuple[Tensor, Tensor]:
    """Random ids and a right-padded attention mask (the last row loses ``pad_last`` tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if pad_last:
        mask[-1, seq - pad_last :] = 0
    return ids, mask


def draft_mapping(draft_vocab: int, seed: int) -> VocabMapping:
    g = torch.Generator().manual_seed(seed)
    return VocabMapping.from_selected_ids(torch.randperm(VOCAB, generator=g)[:draft_vocab], VOCAB)


def put_mapping(client: httpx.Client, url: str, mapping_id: str, mapping: VocabMapping) -> httpx.Response:
    body = tensor_wire.encode({"selected_token_ids": mapping.selected_token_ids})
    return client.put(f"{url}/v1/vocab-mappings/{mapping_id}", content=body)


def supervise(
    client: httpx.Client, url: str, tensors: dict[str, Tensor], **params: str
) -> tuple[dict[str, Tensor], dict[str, str]]:
    response = client.post(f"{url}/v1/supervision", params=params, content=tensor_wire.encode(tensors))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    decoded, metadata = tensor_wire.decode(response.content)
    return decoded, metadata or {}


def reference(
    runner: TargetRunner,
    fmt: str,
    ids: Tensor,
    mask: Tensor,
    mapping: VocabMapping | None = None,
    logits_dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """What the in-process runner gives for the same batch and format."""
    final_hidden, aux = runner.forward_hidden(ids, mask, prenorm=FORMATS[fmt].prenorm)
    return formats.supervision(
        fmt, final_hidden, aux, runner.lm_head_weight(), mapping=mapping, logits_dtype=logits_dtype
    )


def assert_same_tensors(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{name} differs"


def assert_error(response: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    if type_ is not None:
        assert error["type"] == type_
    return error
