"""A bearer token rotated in place (the kubelet's `..data` swap of a mounted Secret) takes effect in the
running server, and a token file that is empty or missing for a while keeps the last good token."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from eagle3_target.protocol import EXIT_INVALID_SETTINGS, TokenFileError
from eagle3_target.server.auth import TokenFile

from support.cluster.waiting import eventually
from support.secret_volume import SecretVolume
from support.server_process import serve_command, start_server, status_code


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
        assert status("first-token") == 401
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
        assert status("second-token") == 401
        assert server.process.poll() is None  # the same process throughout: no restart
        log, metrics = server.log(), httpx.get(f"{server.url}/metrics").text
        assert log.count("the previous bearer token stays in force") == 1
        assert log.count("changed: requests now need its new token") == 2
        assert 'code="401"' in metrics  # the refused requests are counted, their tokens nowhere
        for token in ("first-token", "second-token", "third-token"):
            assert token not in log and token not in metrics
    finally:
        server.stop()


def test_the_token_file_keeps_its_last_good_token_and_warns_once_per_problem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    secret = SecretVolume(tmp_path / "secret", token="one\n")
    tokens = TokenFile(secret.path("token"), interval_s=0)  # looks at the file on every call
    assert tokens.current() == "one"
    secret.update(token="two")
    assert tokens.current() == "two"
    caplog.set_level(logging.WARNING, logger="eagle3_target.server.auth")
    secret.update(token=" \n")
    assert [tokens.current() for _ in range(3)] == ["two"] * 3
    (secret.directory / "..data").unlink()  # the link gone, as between a deletion and a new version
    assert [tokens.current() for _ in range(3)] == ["two"] * 3
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2 and "is empty" in warnings[0] and "No such file" in warnings[1]
    assert not any("two" in warning for warning in warnings)
    secret.update(token="three")
    assert tokens.current() == "three"


def test_the_token_file_is_looked_at_once_per_interval(tmp_path: Path):
    secret = SecretVolume(tmp_path / "secret", token="one")
    tokens = TokenFile(secret.path("token"), interval_s=3600)
    secret.update(token="two")
    assert tokens.current() == "one"


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
