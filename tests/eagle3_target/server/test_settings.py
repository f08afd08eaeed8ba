"""Server settings: engine arguments parsed from flags and the values the settings refuse."""

from __future__ import annotations

import pytest
from eagle3_target.server import settings as settings_module
from eagle3_target.server.settings import ServerSettings, parse_engine_arg
from pydantic import ValidationError


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


@pytest.mark.parametrize("given", ["1,5,9", "1 5 9", " 1, 5 ,9 ", (1, 5, 9), [1, 5, 9]])
def test_capture_layer_ids_are_commas_or_spaces_between_ids(given):
    assert ServerSettings(model="m", capture_layer_ids=given).capture_layer_ids == (1, 5, 9)


def test_capture_layer_ids_from_the_environment_unless_a_flag_gives_them(monkeypatch):
    monkeypatch.setenv("EAGLE3_TARGET_CAPTURE_LAYER_IDS", "9 5,1")
    assert ServerSettings(model="m").capture_layer_ids == (9, 5, 1)
    assert ServerSettings(model="m", capture_layer_ids="2,3").capture_layer_ids == (2, 3)


def test_connection_limits_validate():
    settings = ServerSettings(model="m")
    timeouts = (
        settings.request_header_timeout,
        settings.request_body_timeout,
        settings.response_send_timeout,
    )
    assert (*timeouts, settings.max_connections) == (10.0, 60.0, 30.0, 1024)
    for field, value in [
        ("request_header_timeout", 0),
        ("request_body_timeout", -1),
        ("response_send_timeout", 0),
        ("max_connections", 0),
    ]:
        with pytest.raises(ValueError, match=field):
            ServerSettings(model="m", **{field: value})


def test_the_response_cap_fits_the_containers_memory(monkeypatch, tmp_path):
    limit_file = tmp_path / "memory.max"
    monkeypatch.setattr(settings_module, "_CGROUP_MEMORY_LIMITS", ((str(limit_file), 2**62),))
    limit_file.write_text("max\n")  # no limit: the default
    assert ServerSettings(model="m").response_byte_limit == settings_module.DEFAULT_MAX_RESPONSE_BYTES
    limit_file.write_text(f"{8 * 2**30}\n")  # an 8 GiB pod: a quarter of it
    assert ServerSettings(model="m").response_byte_limit == 2 * 2**30
    assert ServerSettings(model="m", max_response_bytes=1000).response_byte_limit == 1000
    with pytest.raises(ValidationError, match="max_response_bytes must be at least 1"):
        ServerSettings(model="m", max_response_bytes=0)


def test_the_cap_on_answers_in_flight_fits_the_containers_memory(monkeypatch, tmp_path):
    limit_file = tmp_path / "memory.max"
    monkeypatch.setattr(settings_module, "_CGROUP_MEMORY_LIMITS", ((str(limit_file), 2**62),))
    limit_file.write_text("max\n")  # no limit: four of the largest answers
    assert ServerSettings(model="m").in_flight_byte_limit == 4 * settings_module.DEFAULT_MAX_RESPONSE_BYTES
    limit_file.write_text(f"{8 * 2**30}\n")  # an 8 GiB pod: half of it, two of its largest answers
    settings = ServerSettings(model="m")
    assert settings.in_flight_byte_limit == 4 * 2**30 == 2 * settings.response_byte_limit
    assert ServerSettings(model="m", max_response_bytes_in_flight=1000).in_flight_byte_limit == 1000
    with pytest.raises(ValidationError, match="max_response_bytes_in_flight must be at least 1"):
        ServerSettings(model="m", max_response_bytes_in_flight=0)
