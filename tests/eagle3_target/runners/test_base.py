"""Runner-independent helpers: input checks and config reading."""

from types import SimpleNamespace

import torch
from eagle3_target.runners.base import check_inputs, logit_transform, text_config


def test_missing_attention_mask_means_every_token_is_real():
    ids, mask = check_inputs(torch.tensor([[1, 2, 3]], dtype=torch.int32), None, vocab_size=4)
    assert ids.dtype == torch.int64 and torch.equal(mask, torch.ones(1, 3, dtype=torch.int64))


def test_bool_masks_and_right_padding_are_accepted():
    padded = torch.tensor([[1, 1, 1], [1, 0, 0]])
    _, mask = check_inputs(torch.tensor([[1, 2, 3], [3, 0, 0]]), padded.bool(), vocab_size=4)
    assert mask.dtype == torch.int64 and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_text_config_reads_through_multimodal_wrappers():
    inner = SimpleNamespace(num_hidden_layers=12, hidden_size=8, vocab_size=10)
    assert text_config(SimpleNamespace(text_config=inner, num_hidden_layers=None)) is inner
    plain = SimpleNamespace(num_hidden_layers=4)
    assert text_config(plain) is plain
    assert text_config(SimpleNamespace(text_config=None, num_hidden_layers=4)).num_hidden_layers == 4


def test_logit_transform_names_the_field_unless_it_is_the_identity():
    assert logit_transform(SimpleNamespace()) is None
    identity = SimpleNamespace(final_logit_softcapping=None, logit_scale=1.0, logits_scaling=1)
    assert logit_transform(identity) is None
    assert logit_transform(SimpleNamespace(final_logit_softcapping=1.0)) == "final_logit_softcapping"
    assert logit_transform(SimpleNamespace(logit_scale=0.0625)) == "logit_scale"
    assert logit_transform(SimpleNamespace(logits_scaling=8.0)) == "logits_scaling"


def test_logit_scales_that_keep_the_argmax_are_named_too():
    # MiniCPM divides the normed final state by hidden_size / dim_model_base; MuseGlimmer multiplies.
    assert logit_transform(SimpleNamespace(hidden_size=2304, dim_model_base=256)) == "dim_model_base"
    assert logit_transform(SimpleNamespace(hidden_size=256, dim_model_base=256)) is None
    assert logit_transform(SimpleNamespace(hidden_size=256, dim_model_base=None)) is None
    assert logit_transform(SimpleNamespace(output_multiplier=0.25)) == "output_multiplier"
    assert logit_transform(SimpleNamespace(output_multiplier=1.0)) is None
