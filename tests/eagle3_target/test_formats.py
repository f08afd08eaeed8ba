"""The supervision formats: exact against the full-logit math, and each rebuilds NeMo's batch exactly."""

import pytest
import torch
from eagle3_target import formats
from eagle3_target.contract import VocabMapping, build_batch, project_to_draft_vocab
from eagle3_target.formats import batch_from_supervision, logits_from_hidden, probs_from_draft, supervision
from eagle3_target.protocol import FORMATS
from eagle3_target.runners.hf import HFRunner
from eagle3_target.wire import tensors as tensor_wire

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WHOLE_BATCH = 1 << 20  # one chunk: the very GEMM the model's own lm_head runs


@pytest.fixture(scope="module", params=[(arch, dtype) for arch in ("llama", "qwen3") for dtype in DTYPES])
def target(request):
    """One runner output (unpadded forward of a right-padded batch) plus everything the formats need."""
    arch, dtype = request.param
    runner = HFRunner.from_pretrained(request.getfixturevalue(f"tiny_{arch}_dir"), dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 256, (3, 10), generator=gen)
    attention_mask = (torch.arange(10)[None, :] < torch.tensor([[10], [6], [3]])).long()
    loss_mask = attention_mask * torch.randint(0, 2, (3, 10), generator=gen)
    logits, aux = runner.forward_eagle3(input_ids, attention_mask)
    final, _ = runner.forward_hidden(input_ids, attention_mask)
    prenorm, _ = runner.forward_hidden(input_ids, attention_mask, prenorm=True)
    mapping = VocabMapping.from_selected_ids(torch.randperm(256, generator=gen)[:100], 256)
    return {
        "dtype": DTYPES[dtype],
        "logits": logits,
        "aux": aux,
        "final": final,
        "prenorm": prenorm,
        "lm_head": runner.lm_head_weight(),
        "mapping": mapping,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
    }


def test_fixture_exercises_both_supervised_and_unsupervised_positions(target):
    top = target["logits"].argmax(-1)
    in_draft = target["mapping"].selected_token_mask[top]
    assert in_draft.any() and not in_draft.all()


def test_hidden_format_ships_the_runner_tensors(target):
    out = supervision("hidden", target["final"], target["aux"], target["lm_head"])
    assert set(out) == {"aux_hidden_states", "final_hidden"}
    assert out["final_hidden"] is target["final"] and out["aux_hidden_states"] is target["aux"]
    assert torch.equal(logits_from_hidden(out["final_hidden"], target["lm_head"]), target["logits"])


def test_hidden_prenorm_format_ships_the_prenorm_state_with_as_many_bytes_as_hidden(target):
    prenorm = target["prenorm"]
    out = supervision("hidden_prenorm", prenorm, target["aux"], target["lm_head"])
    assert set(out) == {"aux_hidden_states", "final_hidden_prenorm"}
    assert out["final_hidden_prenorm"] is prenorm and out["aux_hidden_states"] is target["aux"]
    hidden = supervision("hidden", target["final"], target["aux"], target["lm_head"])
    assert sum(t.nbytes for t in out.values()) == sum(t.nbytes for t in hidden.values())
    assert not torch.equal(prenorm, target["final"])
    common = (target["input_ids"], target["attention_mask"], target["loss_mask"])
    with pytest.raises(ValueError, match="before the final norm"):
        batch_from_supervision("hidden_prenorm", out, *common, lm_head_weight=target["lm_head"])


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_logits_format_is_the_model_logits_in_the_requested_dtype(target, logits_dtype):
    out = supervision("logits", target["final"], target["aux"], target["lm_head"], logits_dtype=logits_dtype)
    assert set(out) == {"aux_hidden_states", "logits"}
    assert out["logits"].dtype == logits_dtype
    assert torch.equal(out["logits"], target["logits"].to(logits_dtype))


def test_draft_format_is_draft_logits_full_logsumexp_and_full_argmax(target):
    logits, mapping = target["logits"], target["mapping"]
    out = supervision("draft", target["final"], target["aux"], target["lm_head"], mapping=mapping)
    assert set(out) == {"aux_hidden_states", "draft_logits", "logsumexp", "argmax"}
    assert out["draft_logits"].dtype == target["dtype"] and out["draft_logits"].shape == (3, 10, 100)
    assert torch.equal(out["draft_logits"], logits[..., mapping.selected_token_ids])
    assert out["logsumexp"].dtype == torch.float32
    assert torch.equal(out["logsumexp"], torch.logsumexp(logits.float(), dim=-1))
    assert out["argmax"].dtype == torch.int64
    assert torch.equal(out["argmax"], logits.argmax(dim=-1))


def test_probs_format_is_the_unshifted_projection_without_loss_mask(target):
    logits, mapping = target["logits"], target["mapping"]
    out = supervision("probs", target["final"], target["aux"], target["lm_head"], mapping=mapping)
    assert set(out) == {"aux_hidden_states", "target_probs", "position_mask"}
    expected_probs, expected_mask = project_to_draft_vocab(logits, mapping, torch.ones(3, 10))
    assert torch.equal(out["target_probs"], expected_probs)
    assert torch.equal(out["position_mask"], expected_mask.squeeze(-1))


def _assert_same_batch(got, expected):
    for field in (
        "aux_hidden_states",
        "input_ids",
        "attention_mask",
        "loss_mask",
        "target_probs",
        "position_mask",
    ):
        a, b = getattr(got, field), getattr(expected, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), field
    if expected.logits is not None:
        assert torch.equal(got.logits.to(expected.logits.dtype), expected.logits)
    else:
        assert got.logits is None


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not FORMATS[f].prenorm])
def test_every_format_rebuilds_nemos_probs_batch_after_the_wire(target, fmt):
    mapping = target["mapping"]
    sent = supervision(fmt, target["final"], target["aux"], target["lm_head"], mapping=mapping)
    received, _ = tensor_wire.decode(tensor_wire.encode(sent))
    common = (target["input_ids"], target["attention_mask"], target["loss_mask"])
    got = batch_from_supervision(fmt, received, *common, mapping=mapping, lm_head_weight=target["lm_head"])
    expected = build_batch(target["logits"], target["aux"], *common, mapping)
    _assert_same_batch(got, expected)
    assert got.position_mask.any()


@pytest.mark.parametrize("fmt", ["hidden", "logits"])
def test_full_vocab_formats_rebuild_the_logits_batch(target, fmt):
    sent = supervision(fmt, target["final"], target["aux"], target["lm_head"], logits_dtype=target["dtype"])
    common = (target["input_ids"], target["attention_mask"], target["loss_mask"])
    got = batch_from_supervision(fmt, sent, *common, lm_head_weight=target["lm_head"])
    _assert_same_batch(got, build_batch(target["logits"], target["aux"], *common))


@pytest.mark.parametrize("fmt", ["logits", "draft", "probs"])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 16])
def test_chunking_changes_nothing_but_the_gemm_row_count(target, fmt, chunk_tokens):
    args = (fmt, target["final"], target["aux"], target["lm_head"])
    whole = supervision(*args, mapping=target["mapping"], chunk_tokens=WHOLE_BATCH)
    chunked = supervision(*args, mapping=target["mapping"], chunk_tokens=chunk_tokens)
    assert set(whole) == set(chunked)
    if target["dtype"] == torch.bfloat16:
        for name in whole:
            assert torch.equal(whole[name], chunked[name]), name
        return
    # fp32 BLAS kernels may round a logit differently for another row count (an ulp): compare closely,
    # and compare argmax-derived values exactly wherever the top two logits are not within that noise.
    logits = target["logits"].float()
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4
    for name in whole:
        if whole[name].dtype.is_floating_point:
            torch.testing.assert_close(chunked[name], whole[name], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(chunked[name][clear], whole[name][clear]), name
    assert clear.float().mean() > 0.9


@pytest.mark.parametrize("fmt", ["logits", "draft", "probs"])
def test_full_logits_exist_only_one_chunk_at_a_time(target, fmt, monkeypatch):
    seen_rows = []

    def recording_logits_from_hidden(final_hidden, lm_head_weight):
        seen_rows.append(final_hidden.shape[0])
        return logits_from_hidden(final_hidden, lm_head_weight)

    monkeypatch.setattr(formats, "logits_from_hidden", recording_logits_from_hidden)
    supervision(
        fmt, target["final"], target["aux"], target["lm_head"], mapping=target["mapping"], chunk_tokens=8
    )
    assert seen_rows == [8, 8, 8, 6]  # 30 tokens


def test_probs_from_draft_equals_the_projection_in_the_same_frame(target):
    logits, mapping, loss_mask = target["logits"], target["mapping"], target["loss_mask"]
    probs, mask = probs_from_draft(
        logits[..., mapping.selected_token_ids], logits.argmax(-1), mapping, loss_mask
    )
    expected_probs, expected_mask = project_to_draft_vocab(logits, mapping, loss_mask)
    assert torch.equal(probs, expected_probs) and torch.equal(mask, expected_mask)


def test_bad_requests_are_refused(target):
    final, aux, lm_head = target["final"], target["aux"], target["lm_head"]
    with pytest.raises(ValueError, match="unknown supervision format"):
        supervision("topk", final, aux, lm_head)
    for fmt in ("draft", "probs"):
        with pytest.raises(ValueError, match="needs a vocab mapping"):
            supervision(fmt, final, aux, lm_head)
    with pytest.raises(ValueError, match="vocab 300"):
        supervision("draft", final, aux, lm_head, mapping=VocabMapping.from_selected_ids([1, 2], 300))
    with pytest.raises(ValueError, match="chunk_tokens"):
        supervision("logits", final, aux, lm_head, chunk_tokens=0)
    with pytest.raises(ValueError, match="aux_hidden_states"):
        supervision("logits", final, aux[:, :-1], lm_head)
    with pytest.raises(ValueError, match="lm_head"):
        logits_from_hidden(final, lm_head.to(torch.float16))
    common = (target["input_ids"], target["attention_mask"], target["loss_mask"])
    with pytest.raises(ValueError, match="needs tensors"):
        batch_from_supervision("draft", {"aux_hidden_states": aux}, *common, mapping=target["mapping"])
    sent = supervision("probs", final, aux, lm_head, mapping=target["mapping"])
    with pytest.raises(ValueError, match="100 draft tokens, the mapping 2"):
        batch_from_supervision("probs", sent, *common, mapping=VocabMapping.from_selected_ids([1, 2], 256))
    with pytest.raises(ValueError, match="does not match"):
        batch_from_supervision("probs", sent, *common[:2], common[2][:, :5], mapping=target["mapping"])
    with pytest.raises(ValueError, match="needs the lm_head"):
        batch_from_supervision(
            "hidden",
            {"aux_hidden_states": aux, "final_hidden": final},
            target["input_ids"],
            target["attention_mask"],
            target["loss_mask"],
        )


def test_every_protocol_format_has_its_computation_and_ships_its_tensors(target):
    assert list(formats.COMPUTATIONS) == list(FORMATS)
    for fmt, meta in FORMATS.items():
        out = supervision(fmt, target["final"], target["aux"], target["lm_head"], mapping=target["mapping"])
        assert tuple(out) == meta.tensors, fmt


def test_every_formats_size_is_known_before_it_is_computed(target):
    """The server refuses an oversized answer from these sizes before any compute, so they must be exact."""
    for logits_dtype in (torch.float32, torch.bfloat16):
        out_of = {
            fmt: supervision(
                fmt,
                target["prenorm"] if meta.prenorm else target["final"],
                target["aux"],
                target["lm_head"],
                mapping=target["mapping"] if meta.needs_vocab else None,
                logits_dtype=logits_dtype,
            )
            for fmt, meta in FORMATS.items()
        }
        sizes = formats.TokenSizes(
            hidden_size=target["final"].shape[-1],
            vocab_size=target["lm_head"].shape[0],
            draft_vocab_size=target["mapping"].draft_vocab_size,
            model_itemsize=target["dtype"].itemsize,
            logits_itemsize=logits_dtype.itemsize,
        )
        tokens = target["input_ids"].numel()
        for fmt, out in out_of.items():
            assert sum(t.nbytes for t in out.values()) == tokens * formats.bytes_per_token(fmt, sizes), fmt
