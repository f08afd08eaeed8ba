"""Server settings: engine arguments parsed from flags and the values the settings refuse."""

from __future__ import annotations

import pytest
from eagle3_target.server.settings import ServerSettings, parse_engine_arg


@pytest.mark.parametrize(
    ("item", "parsed"),
    [
        ("gpu_memory_utilization=0.85", ("gpu_memory_utilization", 0.85)),
        ("enforce-eager=true", ("enforce_eager", True)),
        ("max_num_seqs=8", ("max_num_seqs", 8)),
        ("kv_cache_dtype=fp8", ("kv_cache_dtype", "fp8")),
        ("cudagraph_capture_sizes=[1,2,4]", ("cudagraph_capture_sizes", [1, 2, 4])),
        ("x=a=b", ("x", "a=b")),
        ("enable_prefix_caching=False", ("enable_prefix_caching", False)),
    ],
)
def test_parse_engine_arg(item, parsed):
    assert parse_engine_arg(item) == parsed


@pytest.mark.parametrize("item", ["novalue", "=3", ""])
def test_parse_engine_arg_rejects(item):
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_arg(item)


def test_settings_validate():
    with pytest.raises(ValueError, match="engine"):
        ServerSettings(model="m", engine="tgi")
    with pytest.raises(ValueError, match="max_queue"):
        ServerSettings(model="m", max_queue=0)
    with pytest.raises(ValueError, match="3 aux"):
        ServerSettings(model="m", aux_layer_ids=(1, 2))
    assert ServerSettings(model="m", max_batch_tokens=10).token_body_limit > 10 * 24
