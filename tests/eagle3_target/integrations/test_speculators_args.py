"""The speculators backend's `--eagle3-target*` flags, parsed by speculators' own `train` config (which
copies a backend flag's type, help and default, but not its action: a repeated flag keeps its last value,
so fail-over URLs go comma-separated in one)."""

from __future__ import annotations

import argparse
from pathlib import Path

import eagle3_target.integrations.speculators as backend  # registers the backend before speculators' parser
import pytest
from eagle3_target.integrations.connect import Connection
from speculators.train.config import TrainConfig


def train_args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    """The namespace speculators' `train` hands the backend (`from_train_args`)."""
    argv = [
        "--verifier-name-or-path", str(tmp_path / "verifier"), "--data-path", str(tmp_path / "data"),
        "--save-path", str(tmp_path / "save"), "--hidden-states-backend", "eagle3-target", *flags,
    ]  # fmt: skip
    return argparse.Namespace(**TrainConfig.resolve(argv).flatten())


def test_a_named_target_is_waited_for_long_enough_for_a_70b_load_unless_told(tmp_path: Path):
    named = backend.connection_from_args(train_args(tmp_path, "--eagle3-target", "llama31-8b"))
    assert named == Connection(target="llama31-8b", wait=900.0)
    told = backend.connection_from_args(
        train_args(
            tmp_path, "--eagle3-target", "llama31-8b", "--eagle3-target-namespace", "ml-training",
            "--eagle3-target-wait", "60", "--eagle3-target-token-file", str(tmp_path / "token"),
            "--eagle3-target-kubeconfig", str(tmp_path / "kubeconfig"),
        )
    )  # fmt: skip
    assert told == Connection(
        target="llama31-8b",
        namespace="ml-training",
        token_file=tmp_path / "token",
        wait=60.0,
        kubeconfig=str(tmp_path / "kubeconfig"),
    )


def test_comma_separated_urls_are_fail_over_endpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    args = train_args(tmp_path, "--eagle3-target", "http://10.0.0.5:8000, http://10.0.0.6:8000")
    assert backend.connection_from_args(args).urls == ("http://10.0.0.5:8000", "http://10.0.0.6:8000")
    with pytest.raises(ValueError, match="needs --eagle3-target"):
        backend.connection_from_args(train_args(tmp_path))
    with pytest.raises(SystemExit):
        train_args(tmp_path, "--eagle3-target", "t", "--eagle3-target-wait", "soon")
    assert "argument --eagle3-target-wait: invalid float value: 'soon'" in capsys.readouterr().err
