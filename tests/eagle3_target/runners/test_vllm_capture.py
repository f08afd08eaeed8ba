"""The vLLM capture layout: HF aux ids to vLLM capture ids and back to the requested order."""

from __future__ import annotations

import pytest
from eagle3_target.runners.vllm_capture import capture_layer_ids, file_positions


def test_capture_ids_and_file_order():
    assert capture_layer_ids([1, 15, 28], 32) == [2, 16, 29, 32]
    assert capture_layer_ids([28, 1, 15], 32) == [29, 2, 16, 32]
    assert file_positions([29, 2, 16, 32]) == [2, 0, 1, 3]
    with pytest.raises(ValueError, match="aux layer id 31"):
        capture_layer_ids([1, 15, 31], 32)
    with pytest.raises(ValueError, match="distinct"):
        capture_layer_ids([1, 1, 2], 32)
