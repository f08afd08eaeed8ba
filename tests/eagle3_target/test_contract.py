"""The supervision contract against NeMo AutoModel's rules, re-derived independently in the tests."""

import pytest
import torch
from eagle3_target.contract import (
    Eagle3TargetBatch,
    VocabMapping,
    build_batch,
    capture_plan,
    default_aux_layer_ids,
    project_to_draft_vocab,
    select_layers,
    shift_left,
    validate_aux_layer_ids,
    validate_capture_layer_ids,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize(
    ("layers", "expected"), [(32, [1, 15, 28]), (36, [1, 17, 32]), (28, [1, 13, 24]), (8, [1, 3, 4])]
)
def test_default_aux_layers_follow_the_eagle3_recipe(layers, expected):
    assert default_aux_layer_ids(layers) == expected


@pytest.mark.parametrize("layers", [0, 1, 2, 3, 4, 5, 6])
def test_default_aux_layers_refuse_shallow_models(layers):
    with pytest.raises(ValueError, match="too shallow"):
        default_aux_layer_ids(layers)


@given(st.integers(min_value=7, max_value=2048))
def test_default_aux_layers_are_valid_for_every_deep_enough_model(layers):
    ids = default_aux_layer_ids(layers)
    assert validate_aux_layer_ids(ids, layers) == ids
    assert ids == sorted(ids)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, 2], "exactly 3"),
        ([1, 2, 3, 4], "exactly 3"),
        ([1, 1, 2], "distinct"),
        ([1, 2, 8], "out of range"),
        ([-1, 2, 3], "out of range"),
        ([1, 2.0, 3], "integers"),
    ],
)
def test_explicit_aux_layers_are_validated(ids, match):
    with pytest.raises(ValueError, match=match):
        validate_aux_layer_ids(ids, 8)


def test_explicit_aux_layers_keep_the_requested_order():
    assert validate_aux_layer_ids((7, 0, 3), 8) == [7, 0, 3]


@given(
    st.integers(1, 4),
    st.integers(1, 9),
    st.lists(st.integers(1, 3), max_size=2),
    st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.bool]),
)
def test_shift_left_moves_every_position_one_slot_earlier_and_zero_fills(batch, seq, rest, dtype):
    t = torch.randint(1, 100, (batch, seq, *rest)).to(dtype)
    out = shift_left(t)
    assert out.shape == t.shape and out.dtype == t.dtype
    for s in range(seq - 1):
        assert torch.equal(out[:, s], t[:, s + 1])
    assert not out[:, seq - 1].any()


def test_shift_left_needs_a_sequence_dim():
    with pytest.raises(ValueError, match=r"\[B, S"):
        shift_left(torch.ones(5))


def _batch_parts():
    return {
        "aux_hidden_states": torch.zeros(1, 2, 6),
        "input_ids": torch.zeros(1, 2, dtype=torch.long),
        "attention_mask": torch.ones(1, 2, dtype=torch.long),
        "loss_mask": torch.ones(1, 2, dtype=torch.long),
    }


def test_batch_needs_exactly_one_supervision_encoding():
    logits = torch.zeros(1, 2, 4)
    probs, mask = torch.zeros(1, 2, 3), torch.zeros(1, 2, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="exactly one"):
        Eagle3TargetBatch(**_batch_parts())
    with pytest.raises(ValueError, match="exactly one"):
        Eagle3TargetBatch(**_batch_parts(), logits=logits, target_probs=probs, position_mask=mask)
    with pytest.raises(ValueError, match="exactly one"):
        Eagle3TargetBatch(**_batch_parts(), target_probs=probs)
    with pytest.raises(ValueError, match="exactly one"):  # a stray half of the other encoding
        Eagle3TargetBatch(**_batch_parts(), logits=logits, target_probs=probs)
    with pytest.raises(ValueError, match="exactly one"):
        Eagle3TargetBatch(**_batch_parts(), logits=logits, position_mask=mask)


def test_trainer_inputs_dispatch_on_the_encoding():
    logits = torch.zeros(1, 2, 4)
    probs, mask = torch.zeros(1, 2, 3), torch.zeros(1, 2, 1, dtype=torch.bool)
    with_logits = Eagle3TargetBatch(**_batch_parts(), logits=logits).to_trainer_inputs()
    assert set(with_logits) == {
        "input_ids",
        "attention_mask",
        "loss_mask",
        "aux_hidden_states",
        "target_logits",
    }
    assert with_logits["target_logits"] is logits
    with_probs = Eagle3TargetBatch(
        **_batch_parts(), target_probs=probs, position_mask=mask
    ).to_trainer_inputs()
    assert with_probs["target_probs"] is probs and with_probs["position_mask"] is mask
    assert "target_logits" not in with_probs


@settings(max_examples=50)
@given(
    st.integers(2, 300).flatmap(lambda v: st.tuples(st.just(v), st.permutations(range(v)), st.integers(1, v)))
)
def test_vocab_mapping_from_ids_marks_exactly_the_selected_tokens(case):
    vocab, perm, draft = case
    ids = perm[:draft]
    mapping = VocabMapping.from_selected_ids(ids, vocab)
    assert mapping.selected_token_ids.tolist() == ids
    assert mapping.selected_token_ids.dtype == torch.int64
    assert mapping.vocab_size == vocab and mapping.draft_vocab_size == draft
    assert [i for i in range(vocab) if mapping.selected_token_mask[i]] == sorted(ids)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([3, 3], "unique"),
        ([0, 10], r"\[0, 10\)"),
        ([-1], r"\[0, 10\)"),
        ([], "empty"),
        ([1.0, 2.0], "integers"),
    ],
)
def test_vocab_mapping_rejects_bad_ids(ids, match):
    ids_t = torch.tensor(ids) if ids else torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        VocabMapping.from_selected_ids(ids_t, 10)


def test_vocab_mapping_rejects_an_inconsistent_mask():
    ids = torch.tensor([1, 4])
    mask = torch.zeros(8, dtype=torch.bool)
    mask[1] = True
    with pytest.raises(ValueError, match="exactly at"):
        VocabMapping(ids, mask)
    mask[[4, 5]] = True
    with pytest.raises(ValueError, match="exactly at"):
        VocabMapping(ids, mask)
    with pytest.raises(ValueError, match="int64"):
        VocabMapping(ids.int(), mask)
    with pytest.raises(ValueError, match="bool"):
        VocabMapping(ids, mask.long())


def test_vocab_mapping_digest_depends_on_ids_order_and_vocab():
    a = VocabMapping.from_selected_ids([1, 2, 3], 10)
    assert a.digest() == VocabMapping.from_selected_ids([1, 2, 3], 10).digest()
    assert a.digest() != VocabMapping.from_selected_ids([2, 1, 3], 10).digest()
    assert a.digest() != VocabMapping.from_selected_ids([1, 2, 3], 11).digest()


def _nemo_projection_reference(logits, ids, loss_mask):
    """NeMo's `_compute_target_distribution`, rebuilt position by position."""
    batch, seq, _ = logits.shape
    probs = torch.empty(batch, seq, len(ids))
    mask = torch.empty(batch, seq, 1, dtype=torch.bool)
    for b in range(batch):
        for s in range(seq):
            row = logits[b, s]
            probs[b, s] = torch.softmax(row[torch.tensor(ids)].float(), dim=-1)
            mask[b, s, 0] = int(row.argmax()) in ids and bool(loss_mask[b, s])
    return probs, mask


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 8), st.integers(1, 20))
def test_projection_matches_nemo_position_by_position(seed, batch, seq, draft):
    gen = torch.Generator().manual_seed(seed)
    vocab = 24
    logits = torch.randn(batch, seq, vocab, generator=gen) * 3
    ids = torch.randperm(vocab, generator=gen)[:draft].tolist()
    loss_mask = torch.randint(0, 2, (batch, seq), generator=gen)
    probs, mask = project_to_draft_vocab(logits, VocabMapping.from_selected_ids(ids, vocab), loss_mask)
    ref_probs, ref_mask = _nemo_projection_reference(logits, ids, loss_mask)
    assert probs.dtype == torch.float32 and mask.dtype == torch.bool
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(mask, ref_mask)
    assert not (mask.squeeze(-1) & ~loss_mask.bool()).any()


def test_projection_rejects_mismatched_vocab_and_loss_mask():
    mapping = VocabMapping.from_selected_ids([0, 1], 5)
    with pytest.raises(ValueError, match="vocab"):
        project_to_draft_vocab(torch.zeros(1, 2, 6), mapping, torch.ones(1, 2))
    with pytest.raises(ValueError, match="loss_mask"):
        project_to_draft_vocab(torch.zeros(1, 2, 5), mapping, torch.ones(1, 3))


def _runner_output(seed=0, batch=2, seq=6, hidden=4, vocab=16, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 2).to(dtype)
    aux = torch.randn(batch, seq, 3 * hidden, generator=gen).to(dtype)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, 4:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, 0] = 0
    return logits, aux, input_ids, attention_mask, loss_mask


def test_logits_batch_shifts_ids_masks_and_logits_but_not_aux_or_attention():
    logits, aux, input_ids, attention_mask, loss_mask = _runner_output()
    batch = build_batch(logits, aux, input_ids, attention_mask, loss_mask)
    assert batch.aux_hidden_states is aux and batch.attention_mask is attention_mask
    assert batch.target_probs is None and batch.position_mask is None
    seq = input_ids.shape[1]
    for s in range(seq - 1):
        assert torch.equal(batch.input_ids[:, s], input_ids[:, s + 1])
        assert torch.equal(batch.loss_mask[:, s], loss_mask[:, s + 1])
        assert torch.equal(batch.logits[:, s], logits[:, s + 1])
    assert not batch.input_ids[:, -1].any() and not batch.loss_mask[:, -1].any()
    assert not batch.logits[:, -1].any() and batch.logits.dtype == logits.dtype


def test_probs_batch_is_the_projection_of_the_shifted_logits():
    logits, aux, input_ids, attention_mask, loss_mask = _runner_output()
    ids = [3, 0, 7, 12, 5]
    batch = build_batch(
        logits, aux, input_ids, attention_mask, loss_mask, VocabMapping.from_selected_ids(ids, 16)
    )
    assert batch.logits is None
    zero = torch.zeros_like(logits[:, :1])
    shifted_logits = torch.cat([logits[:, 1:], zero], dim=1)
    shifted_loss = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)
    ref_probs, ref_mask = _nemo_projection_reference(shifted_logits, ids, shifted_loss)
    torch.testing.assert_close(batch.target_probs, ref_probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(batch.position_mask, ref_mask)
    # The appended zero row projects to a uniform distribution that is never supervised.
    torch.testing.assert_close(batch.target_probs[:, -1], torch.full((2, len(ids)), 1 / len(ids)))
    assert not batch.position_mask[:, -1].any()


def test_build_batch_rejects_misaligned_inputs():
    logits, aux, input_ids, attention_mask, loss_mask = _runner_output()
    with pytest.raises(ValueError, match="aux_hidden_states"):
        build_batch(logits, aux[..., :-1], input_ids, attention_mask, loss_mask)
    with pytest.raises(ValueError, match="does not match"):
        build_batch(logits[:, :-1], aux, input_ids, attention_mask, loss_mask)
    with pytest.raises(ValueError, match="does not match"):
        build_batch(logits, aux, input_ids, attention_mask, loss_mask[:1])


def test_capture_sets_are_validated_in_their_order():
    assert validate_capture_layer_ids([7, 0, 3], 8) == [7, 0, 3]
    assert validate_capture_layer_ids(list(range(32)), 40) == list(range(32))
    for ids, reason in (
        ([], "1 to 32 layer ids, got 0"),
        (list(range(33)), "1 to 32 layer ids, got 33"),
        ([1, 1], "must be distinct"),
        ([8], "capture layer id 8 is out of range for a model with 8 layers"),
        ([-1], "capture layer id -1 is out of range"),
        ([1.5], "must be integers"),
    ):
        with pytest.raises(ValueError, match=reason):
            validate_capture_layer_ids(ids, 8)


def test_capture_plan_defaults_and_requires_the_aux_layers():
    assert capture_plan(8, None, None) == ([1, 3, 4], [1, 3, 4])
    assert capture_plan(8, [0, 2, 5], None) == ([0, 2, 5], [0, 2, 5])
    assert capture_plan(8, None, [7, 4, 3, 1]) == ([1, 3, 4], [7, 4, 3, 1])
    with pytest.raises(ValueError, match=r"the aux layers \[1, 3, 4\] must be captured, .* lacks \[3, 4\]"):
        capture_plan(8, None, [1, 5, 7])
    with pytest.raises(ValueError, match="too shallow"):
        capture_plan(3, None, [0, 1, 2])  # the default aux layers need a deeper model; explicit ones do not
    assert capture_plan(3, [0, 1, 2], [2, 1, 0]) == ([0, 1, 2], [2, 1, 0])


def test_select_layers_picks_layers_in_the_order_wanted():
    hidden = 4
    layers = {i: torch.full((2, 3, hidden), float(i)) for i in (7, 1, 3, 0)}
    captured = torch.cat([layers[i] for i in (7, 1, 3, 0)], dim=-1)
    assert select_layers(captured, [7, 1, 3, 0], [7, 1, 3, 0]) is captured  # all of it: no copy
    picked = select_layers(captured, [7, 1, 3, 0], [0, 7])
    assert torch.equal(picked, torch.cat([layers[0], layers[7]], dim=-1))
    assert torch.equal(select_layers(captured, [7, 1, 3, 0], [3]), layers[3])
    with pytest.raises(ValueError, match=r"layers \[2\] are not among the captured layers \[7, 1, 3, 0\]"):
        select_layers(captured, [7, 1, 3, 0], [1, 2])
