"""Talking to a target server under test: seeded token batches, requests, the in-process reference its
answers must equal, and checks on its HTTP answers. Shared by the server, client and operator tests."""

from __future__ import annotations

import socket
from typing import NamedTuple

import httpx
import torch
from eagle3_target import formats
from eagle3_target.contract import Eagle3TargetBatch, VocabMapping
from eagle3_target.formats import TokenSizes
from eagle3_target.protocol import FORMATS
from eagle3_target.runners import TargetRunner
from eagle3_target.wire import tensors as tensor_wire
from prometheus_client.parser import text_string_to_metric_families
from torch import Tensor

from support.cluster.waiting import LOOPBACK
from support.server_process import connect

VOCAB = 256


class TokenBatch(NamedTuple):
    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor


def ragged_rows(vocab_size: int) -> tuple[Tensor, Tensor]:
    """Four right-padded rows of 61, 40, 17 and 1 tokens: more rows than one length, one of a single token
    (the engines' agreement tests with HF)."""
    gen = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, vocab_size, (4, 61), generator=gen)
    mask = (torch.arange(61)[None, :] < torch.tensor([61, 40, 17, 1])[:, None]).long()
    return input_ids, mask


def token_batch(seed: int, batch: int = 2, seq: int = 16, pad_last: int = 0) -> TokenBatch:
    """Seeded random ids, a right-padded attention mask (the last row loses `pad_last` tokens) and a random
    loss mask inside it."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    if pad_last:
        attention_mask[-1, seq - pad_last :] = 0
    loss_mask = torch.randint(0, 2, (batch, seq), generator=g) * attention_mask
    return TokenBatch(input_ids, attention_mask, loss_mask)


def draft_mapping(draft_vocab: int, seed: int) -> VocabMapping:
    g = torch.Generator().manual_seed(seed)
    return VocabMapping.from_selected_ids(torch.randperm(VOCAB, generator=g)[:draft_vocab], VOCAB)


def bytes_per_token(fmt: str, *, hidden: int, vocab: int, draft_vocab: int = 0, itemsize: int = 4) -> int:
    """Data bytes per token of a `fmt` answer (aux is 3 layers in the model's `itemsize`, logits fp32)."""
    sizes = TokenSizes(hidden, vocab, draft_vocab, model_itemsize=itemsize, logits_itemsize=4)
    return formats.bytes_per_token(fmt, sizes)


def logits_request(input_ids: Tensor) -> bytes:
    """A whole `logits` supervision request for `input_ids`, as raw bytes for a raw socket."""
    body = tensor_wire.encode({"input_ids": input_ids})
    head = (
        f"POST /v1/supervision?format=logits HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def stalled_reader(url: str, input_ids: Tensor) -> socket.socket:
    """A client that sends a `logits` request for `input_ids` and never reads the answer (its receive
    buffer kept small, so the answer stalls in the server)."""
    sock = connect(url)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(logits_request(input_ids))
    return sock


def in_flight(url: str) -> int:
    """The data requests the server counts as in flight (what tells the operator the target is in use)."""
    return int(httpx.get(url + "/readyz").json()["activity"]["inFlight"])


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


def assert_close_at_real_positions(
    got: dict[str, Tensor], want: dict[str, Tensor], mask: Tensor, atol: float, fmt: str
) -> None:
    """Another engine's answer: the same tensors, dtypes and values within `atol` where `mask` is set (the
    HF engine computes padding positions too, the vLLM engine leaves them zero)."""
    valid = mask.bool()
    assert sorted(got) == sorted(want), fmt
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and tensor.shape[:2] == valid.shape, f"{fmt}.{name}"
        label = f"{fmt}.{name}"

        def labelled(message: str, label: str = label) -> str:
            return f"{label}: {message}"

        torch.testing.assert_close(got[name][valid], tensor[valid], atol=atol, rtol=atol, msg=labelled)


def assert_every_format_matches(
    runner: TargetRunner, hf: TargetRunner, input_ids: Tensor, mask: Tensor, atol: float
) -> None:
    """Another engine's runner against the HF runner: every format has the format's tensors and equals the
    HF one at real positions (the vocab formats with one draft mapping)."""
    mapping = draft_mapping(64, seed=3)
    for fmt, spec in FORMATS.items():
        got = reference(runner, fmt, input_ids, mask, mapping if spec.needs_vocab else None)
        want = reference(hf, fmt, input_ids, mask, mapping if spec.needs_vocab else None)
        assert sorted(got) == sorted(want) == sorted(spec.tensors), fmt
        assert_close_at_real_positions(got, want, mask, atol, fmt)


def assert_same_batch(got: Eagle3TargetBatch, want: Eagle3TargetBatch, atol: float) -> None:
    """Two trainer batches (TargetClient.batch) from different engines: the same fields, within `atol`."""
    for name in ("aux_hidden_states", "input_ids", "attention_mask", "loss_mask", "logits", "target_probs"):
        mine, theirs = getattr(got, name), getattr(want, name)
        assert (mine is None) == (theirs is None), name
        if theirs is not None:

            def labelled(message: str, label: str = name) -> str:
                return f"{label}: {message}"

            torch.testing.assert_close(mine, theirs, atol=atol, rtol=atol, msg=labelled)
    if want.position_mask is not None:
        assert got.position_mask is not None and torch.equal(got.position_mask, want.position_mask)


def assert_error(response: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    if type_ is not None:
        assert error["type"] == type_
    return error


def assert_still_serving(url: str) -> None:
    """The server answers a plain supervision request after whatever the test sent it."""
    assert httpx.get(url + "/healthz").status_code == 200
    ids, mask, _ = token_batch(seed=0, batch=1, seq=8)
    ok = httpx.post(
        url + "/v1/supervision", content=tensor_wire.encode({"input_ids": ids, "attention_mask": mask})
    )
    assert ok.status_code == 200
    assert set(tensor_wire.decode(ok.content)[0]) == {"aux_hidden_states", "final_hidden"}


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, keyed by name and sorted labels."""
    text = httpx.get(url + "/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
