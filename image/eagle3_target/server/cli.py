"""The ``eagle3-target serve`` command: one flag per `ServerSettings` field, then uvicorn.

The flags are derived from the settings class, so a new setting is one field there. Only the flags given
are passed on: what is not given comes from ``EAGLE3_TARGET_*`` variables, else the field's default.
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn, get_args, get_origin

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from eagle3_target.server.settings import ENV_PREFIX, ServerSettings, describe

# Keep idle keep-alive connections open across long training steps: NeMo's client holds one session per
# server and its vocab mapping is bound to that connection (uvicorn's default would drop it after 5 s).
KEEP_ALIVE_SECONDS = 600


def flag_help(name: str, field: FieldInfo) -> str:
    """A setting's `--help` text: its description, the variable read when the flag is not given, and its
    default where it has one that is a value (a None default's description says what happens then).

    Written as typer writes `envvar=` and `show_default=`, which cannot be used: typer's default would
    hide whether a flag was given, and a variable's value must be checked by `ServerSettings`, so that a
    refused one reaches the termination log like a flag's. "\\[" keeps rich markup from reading a tag.
    """
    parts = [field.description or "", f"\\[env var: {ENV_PREFIX}{name.upper()}]"]
    if not (field.is_required() or field.default is None or field.default_factory is not None):
        parts.append(f"\\[default: {field.default}]")
    return " ".join(parts).lstrip()


def _flag(name: str, field: FieldInfo) -> inspect.Parameter:
    """One setting as a flag: the field's type, optional (None means "not given"), `flag_help` as help.

    A dict field is a repeatable KEY=VALUE flag, a tuple of any length one comma-separated word;
    `json_schema_extra={"flag": ...}` renames a flag.
    """
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flag = "--" + str(extra.get("flag", name.replace("_", "-")))
    kind: Any = field.annotation
    if get_origin(field.annotation) is dict:
        kind = list[str]
    elif any(get_args(arm)[-1:] == (Ellipsis,) for arm in get_args(field.annotation)):
        kind = str
    option = typer.Option(flag, help=flag_help(name, field))
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


def given_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags on the command line: unset ones (None, or a repeatable flag never given) are left out."""
    return {name: value for name, value in flags.items() if value is not None and value not in ((), [])}


def serve(**flags: Any) -> None:
    """Serve a frozen target model's EAGLE-3 supervision over HTTP.

    Exits 2 for settings it refuses and 3 when the model cannot be loaded, with one line saying what and what
    to do on stderr and in the termination log. Weights still arriving in the model directory are waited for.
    """
    import uvicorn

    from eagle3_target.protocol import (
        EXIT_ENGINE_FAILED,
        EXIT_INVALID_SETTINGS,
        EXIT_LOAD_FAILED,
        TokenFileError,
    )
    from eagle3_target.server.app import create_app
    from eagle3_target.server.http_protocol import (
        ConnectionGuard,
        ConnectionLimits,
        HardenedHttpProtocol,
        connection_budget,
        open_fd_count,
        raise_fd_limit,
    )
    from eagle3_target.server.loading import LoadFailed, failure_line, preflight, write_termination_message
    from eagle3_target.server.logs import configure_json_logging
    from eagle3_target.server.target import engine_kwargs

    given = given_flags(flags)
    termination_log = Path(
        given.get("termination_log")
        or os.environ.get(ENV_PREFIX + "TERMINATION_LOG")
        or ServerSettings.model_fields["termination_log"].default
    )

    def refuse(line: str, code: int) -> NoReturn:
        write_termination_message(termination_log, line)
        typer.echo(f"eagle3-target serve: {line}", err=True)
        raise typer.Exit(code)

    try:
        settings = ServerSettings(**given)
    except ValidationError as exc:
        action = "fix the server's flags or EAGLE3_TARGET_* variables"
        refuse(f"invalid setting: {describe(exc)}; {action}", EXIT_INVALID_SETTINGS)
    try:  # What is refused at once never binds the port.
        preflight(settings.model, settings.engine, engine_kwargs(settings))
    except LoadFailed as exc:
        refuse(failure_line(exc), EXIT_LOAD_FAILED)
    configure_json_logging(settings.log_level.upper())
    try:
        app = create_app(settings)
    except TokenFileError as exc:
        action = "point --auth-token-file at a file holding the bearer token"
        refuse(f"invalid setting: auth_token_file: {exc}; {action}", EXIT_INVALID_SETTINGS)
    state = app.state.server
    if settings.metrics_port:
        import prometheus_client

        registry = state.metrics.registry
        prometheus_client.start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
    budget = connection_budget(settings.max_connections, raise_fd_limit(), open_fd_count())
    limits = ConnectionLimits(
        settings.request_header_timeout,
        settings.request_body_timeout,
        settings.response_send_timeout,
        budget.max_connections,
    )
    guard = ConnectionGuard(limits, state.metrics)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            loop="uvloop",
            # uvicorn builds the protocol per connection by calling what it is given like a class.
            http=functools.partial(HardenedHttpProtocol, guard=guard),  # type: ignore[arg-type]
            ws="none",
            backlog=budget.backlog,
        )
    )
    state.on_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.loading.failure is not None:
        raise typer.Exit(EXIT_LOAD_FAILED)  # the loader already logged and wrote the line
    if state.engine_failure is not None:
        raise typer.Exit(EXIT_ENGINE_FAILED)  # as the state did, when it found the engine dead


# typer reads a command's flags from its signature.
serve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [_flag(name, field) for name, field in ServerSettings.model_fields.items()]
)
