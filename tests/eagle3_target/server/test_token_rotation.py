"""A bearer token rotated in place (the kubelet's `..data` swap of a mounted Secret) takes effect in the
running server while the token before it stays accepted for a grace period (the trainers' copies of the
Secret lag), and a token file that is empty or missing for a while keeps the last good token."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from eagle3_target.protocol import EXIT_INVALID_SETTINGS, TokenFileError
from eagle3_target.server.app import create_app
from eagle3_target.server.auth import BearerAuthMiddleware, TokenFile
from eagle3_target.server.settings import ServerSettings

from support.cluster.waiting import eventually
from support.secret_volume import SecretVolume
from support.server_process import serve_command, serve_in_thread, start_server, status_code

ROTATED = "changed: its new token is accepted"


def test_a_rotated_token_file_takes_effect_without_a_restart(server_model_dir: Path, tmp_path: Path):
    secret = SecretVolume(tmp_path / "secret", token="first-token\n")
    server = start_server(
        tmp_path,
        ["--model", str(server_model_dir), "--engine", "hf", "--dtype", "float32",
         "--auth-token-file", str(secret.path("token"))],
    )  # fmt: skip
    try:

        def status(token: str | None) -> int | None:  # a data route, behind the token
            headers = {"Authorization": f"Bearer {token}"} if token is not None else None
            return status_code(f"{server.url}/v1/weights/final_norm", headers)

        assert (status("first-token"), status("second-token")) == (200, 401)
        secret.update(token="second-token\n")
        eventually(lambda: status("second-token") == 200, "the rotated token to be accepted", timeout=30)
        assert status("first-token") == 200  # in its grace period: the trainers' copies lag the server's
        secret.update(token="")
        # The file is looked at when a request comes: each poll sends one, with the token still in force.
        eventually(
            lambda: status("second-token") == 200 and "is empty" in server.log(),
            "a warning about the empty token file",
            timeout=30,
        )
        assert status(None) == 401  # no token is not the empty file's token
        secret.update(token="third-token")
        eventually(lambda: status("third-token") == 200, "the next token to be accepted", timeout=30)
        # A second rotation within the grace period drops the oldest token and keeps the one before it.
        assert (status("second-token"), status("first-token")) == (200, 401)
        assert server.process.poll() is None  # the same process throughout: no restart
        log, metrics = server.log(), httpx.get(f"{server.url}/metrics").text
        assert log.count("the previous bearer token stays in force") == 1
        assert log.count(ROTATED) == 2 and log.count("the previous one for 180s more") == 2
        assert 'code="401"' in metrics  # the refused requests are counted, their tokens nowhere
        for token in ("first-token", "second-token", "third-token"):
            assert token not in log and token not in metrics
    finally:
        server.stop()


def test_the_token_before_a_rotation_is_accepted_for_the_grace_period_only(
    server_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """The server's app behind the middleware on a real socket, its clock in the test's hands."""
    secret = SecretVolume(tmp_path / "secret", token="first-token")
    now = [1000.0]
    tokens = TokenFile(secret.path("token"), interval_s=0, grace_s=180, clock=lambda: now[0])
    app = create_app(ServerSettings(model=str(server_model_dir), engine="hf", dtype="float32"))
    caplog.set_level(logging.INFO, logger="eagle3_target.server.auth")
    with serve_in_thread(BearerAuthMiddleware(app, tokens)) as url:
        eventually(lambda: status_code(f"{url}/readyz") == 200, "the model to load", timeout=180)

        def accepted() -> set[str]:
            candidates = ("first-token", "second-token", "third-token", "fourth-token")
            headers = {token: {"Authorization": f"Bearer {token}"} for token in candidates}
            return {
                token
                for token in candidates
                if status_code(f"{url}/v1/weights/final_norm", headers[token]) == 200
            }

        assert accepted() == {"first-token"}
        secret.update(token="second-token")
        assert accepted() == {"first-token", "second-token"}
        now[0] += 179
        assert accepted() == {"first-token", "second-token"}
        now[0] += 1
        assert accepted() == {"second-token"}
        assert status_code(f"{url}/v1/weights/final_norm", {"Authorization": "Bearer first-token"}) == 401
        secret.update(token="")
        assert accepted() == {"second-token"}  # an empty file keeps the last good token
        secret.update(token="third-token")
        assert accepted() == {"second-token", "third-token"}
        now[0] += 10
        secret.update(token="fourth-token")  # within the grace period: the oldest goes
        assert accepted() == {"third-token", "fourth-token"}
    log = caplog.text
    assert log.count(ROTATED) == 3 and log.count("is no longer accepted") == 1
    assert not any(token in log for token in ("first-token", "second-token", "third-token", "fourth-token"))


def test_the_token_file_keeps_its_last_good_token_and_warns_once_per_problem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    secret = SecretVolume(tmp_path / "secret", token="one\n")
    tokens = TokenFile(secret.path("token"), interval_s=0, grace_s=0)  # looks at the file on every call
    assert tokens.accepted() == ("one",)
    secret.update(token="two")
    assert tokens.accepted() == ("two",)
    caplog.set_level(logging.WARNING, logger="eagle3_target.server.auth")
    secret.update(token=" \n")
    assert [tokens.accepted() for _ in range(3)] == [("two",)] * 3
    (secret.directory / "..data").unlink()  # the link gone, as between a deletion and a new version
    assert [tokens.accepted() for _ in range(3)] == [("two",)] * 3
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2 and "is empty" in warnings[0] and "No such file" in warnings[1]
    assert not any("two" in warning for warning in warnings)
    secret.update(token="three")
    assert tokens.accepted() == ("three",)


def test_the_token_file_is_looked_at_once_per_interval(tmp_path: Path):
    secret = SecretVolume(tmp_path / "secret", token="one")
    tokens = TokenFile(secret.path("token"), interval_s=3600)
    secret.update(token="two")
    assert tokens.accepted() == ("one",)


def test_a_start_without_a_token_is_refused(server_model_dir: Path, tmp_path: Path):
    """Exit 2 with the reason in the termination log, before the port is bound."""
    (tmp_path / "empty").write_text("\n")
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    for path, reason in ((tmp_path / "empty", "is empty"), (tmp_path / "missing", "No such file")):
        with pytest.raises(TokenFileError, match=reason):
            TokenFile(path)
    refused = subprocess.run(
        [*serve_command(), "serve", "--model", str(server_model_dir), "--engine", "hf",
         "--auth-token-file", str(tmp_path / "empty"), "--termination-log", str(termination_log)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert refused.returncode == EXIT_INVALID_SETTINGS, refused.stderr
    line = termination_log.read_text()
    assert "auth_token_file" in line and "is empty" in line and line in refused.stderr
