"""`eagle3-target serve` has exactly one flag per server setting, typed like it and documented in --help."""

import typer
from eagle3_target.cli import app
from eagle3_target.server.cli import given_flags
from eagle3_target.server.settings import ServerSettings


def serve_command():
    return typer.main.get_command(app).commands["serve"]


def test_one_flag_per_setting():
    params = {param.name: param for param in serve_command().params}
    assert set(params) == set(ServerSettings.model_fields)
    assert params["engine_args"].opts == ["--engine-arg"] and params["engine_args"].multiple
    assert params["aux_layer_ids"].nargs == 3
    assert params["capture_layer_ids"].nargs == 1  # one comma-separated word, any number of ids
    ctx = serve_command().make_context("serve", ["--model", "/m", "--capture-layer-ids", "7,1,3"])
    assert ServerSettings(**given_flags(ctx.params)).capture_layer_ids == (7, 1, 3)


def test_only_given_flags_reach_the_settings():
    ctx = serve_command().make_context("serve", ["--model", "/m", "--max-queue", "3", "--engine-arg", "a=1"])
    given = given_flags(ctx.params)
    assert given == {"model": "/m", "max_queue": 3, "engine_args": ["a=1"]}
    settings = ServerSettings(**given)
    assert (settings.max_queue, settings.engine_args, settings.port) == (3, {"a": 1}, 8000)


def test_an_unset_flag_leaves_the_environment_in_charge(monkeypatch):
    monkeypatch.setenv("EAGLE3_TARGET_ENGINE_ARGS", "enforce_eager=true max_num_seqs=4")
    given = given_flags(serve_command().make_context("serve", ["--model", "/m"]).params)
    assert given == {"model": "/m"}
    assert ServerSettings(**given).engine_args == {"enforce_eager": True, "max_num_seqs": 4}


def test_help_shows_each_settings_variable_and_default():
    """`serve --help` says, per flag, the variable read when it is not given and the default. Each row is
    read from the help record click renders, so the terminal's width and colours do not matter."""
    command = serve_command()
    ctx = command.make_context("serve", ["--model", "/m"])
    params = [param for param in command.params if param.name in ServerSettings.model_fields]
    assert len(params) == len(ServerSettings.model_fields)
    for param in params:
        record = param.get_help_record(ctx)
        assert record is not None, param.name
        row, field = record[1].replace("\\[", "["), ServerSettings.model_fields[param.name]
        assert f"[env var: EAGLE3_TARGET_{param.name.upper()}]" in row, row
        if field.is_required():
            assert "(required)" in row, row
        elif field.default_factory is not None:
            assert "(repeatable" in row, row
        elif field.default is None:
            assert "default: " in row, row  # the description says what an unset one means
        else:
            assert f"[default: {field.default}]" in row, row
