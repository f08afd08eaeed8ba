"""The ``eagle3-target serve`` command: flags (or ``EAGLE3_TARGET_*`` env) to settings, then uvicorn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

ENV = "EAGLE3_TARGET_"
# Keep idle keep-alive connections open across long training steps: NeMo's client holds one session per
# server and its vocab mapping is bound to that connection (uvicorn's default would drop it after 5 s).
KEEP_ALIVE_SECONDS = 600


def serve(
    model: Annotated[str, typer.Option(envvar=ENV + "MODEL", help="Local model directory.")],
    engine: Annotated[str, typer.Option(envvar=ENV + "ENGINE", help="vllm or hf.")] = "vllm",
    dtype: Annotated[
        str, typer.Option(envvar=ENV + "DTYPE", help="Model dtype: auto, bfloat16, float32...")
    ] = "auto",
    aux_layer_ids: Annotated[
        tuple[int, int, int] | None,
        typer.Option(envvar=ENV + "AUX_LAYER_IDS", help="Three HF aux layer ids; default [1, L//2-1, L-4]."),
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option(envvar=ENV + "TENSOR_PARALLEL_SIZE", help="GPUs per replica (vllm).")
    ] = 1,
    max_model_len: Annotated[
        int | None, typer.Option(envvar=ENV + "MAX_MODEL_LEN", help="Longest accepted sequence.")
    ] = None,
    engine_arg: Annotated[
        list[str] | None,
        typer.Option(envvar=ENV + "ENGINE_ARGS", help="Extra engine argument KEY=VALUE (repeatable)."),
    ] = None,
    host: Annotated[str, typer.Option(envvar=ENV + "HOST")] = "0.0.0.0",
    port: Annotated[int, typer.Option(envvar=ENV + "PORT")] = 8000,
    max_batch_tokens: Annotated[
        int,
        typer.Option(envvar=ENV + "MAX_BATCH_TOKENS", help="Most tokens per request and per engine batch."),
    ] = 32768,
    max_queue: Annotated[
        int,
        typer.Option(envvar=ENV + "MAX_QUEUE", help="Requests that may wait for the engine; more get 429."),
    ] = 64,
    auth_token_file: Annotated[
        Path | None, typer.Option(envvar=ENV + "AUTH_TOKEN_FILE", help="Require this bearer token.")
    ] = None,
    trust_remote_code: Annotated[bool, typer.Option(envvar=ENV + "TRUST_REMOTE_CODE")] = False,
    model_name: Annotated[
        str | None, typer.Option(envvar=ENV + "MODEL_NAME", help="Name in /v1/info.")
    ] = None,
    revision: Annotated[
        str | None, typer.Option(envvar=ENV + "REVISION", help="Revision in /v1/info.")
    ] = None,
    log_level: Annotated[str, typer.Option(envvar=ENV + "LOG_LEVEL")] = "INFO",
    termination_log: Annotated[
        Path,
        typer.Option(
            envvar=ENV + "TERMINATION_LOG",
            help="Where a failed start writes its one-line reason, if the file exists (Kubernetes makes it).",
        ),
    ] = Path("/dev/termination-log"),
) -> None:
    """Serve a frozen target model's EAGLE-3 supervision over HTTP.

    Exits 2 for settings it refuses and 3 when the model cannot be loaded, with one line saying what and what
    to do on stderr and in the termination log. Weights still arriving in the model directory are waited for.
    """
    import uvicorn

    from eagle3_target.protocol import EXIT_INVALID_SETTINGS, EXIT_LOAD_FAILED
    from eagle3_target.server.app import create_app
    from eagle3_target.server.http_protocol import JsonErrorHTTPProtocol
    from eagle3_target.server.loading import LoadFailed, failure_line, preflight, write_termination_message
    from eagle3_target.server.logs import configure_json_logging
    from eagle3_target.server.settings import ServerSettings, parse_engine_args
    from eagle3_target.server.target import engine_kwargs

    def refuse(line: str, code: int) -> NoReturn:
        write_termination_message(termination_log, line)
        typer.echo(f"eagle3-target serve: {line}", err=True)
        raise typer.Exit(code)

    try:
        settings = ServerSettings(
            model=model,
            engine=engine,
            dtype=dtype,
            aux_layer_ids=aux_layer_ids,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            engine_args=parse_engine_args(engine_arg or []),
            host=host,
            port=port,
            max_batch_tokens=max_batch_tokens,
            max_queue=max_queue,
            auth_token_file=auth_token_file,
            trust_remote_code=trust_remote_code,
            model_name=model_name,
            revision=revision,
            termination_log=termination_log,
        )
    except ValueError as exc:
        action = "fix the server's flags or EAGLE3_TARGET_* variables"
        refuse(f"invalid setting: {exc}; {action}", EXIT_INVALID_SETTINGS)
    try:  # What is refused at once never binds the port.
        preflight(settings.model, settings.engine, engine_kwargs(settings))
    except LoadFailed as exc:
        refuse(failure_line(exc), EXIT_LOAD_FAILED)
    configure_json_logging(log_level.upper())
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            http=JsonErrorHTTPProtocol,
        )
    )
    state = app.state.server
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.loading.failure is not None:
        raise typer.Exit(EXIT_LOAD_FAILED)  # the loader already logged and wrote the line
