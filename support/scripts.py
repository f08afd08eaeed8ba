"""The `scripts/` programs as the tests load and run them: a script imported as a module by its file name,
and a typer script's JSON lines (one per check) with its exit code."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from typer.testing import CliRunner

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/NAME.py as the module NAME (registered for the test only: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def invoke_json_lines(script: ModuleType, args: list[str]) -> tuple[int, list[dict[str, Any]]]:
    """The script's exit code and the JSON lines it printed."""
    result = CliRunner().invoke(script.app, args)
    return result.exit_code, [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
