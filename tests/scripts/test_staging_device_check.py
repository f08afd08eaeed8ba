"""The staging device check (scripts/staging_device_check.py, run by scripts/gpu_check.sh on a GPU): here it
runs on the CPU, where the engine's outputs must reach the response untouched and nothing waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "staging_device_check.py"


def test_cpu_outputs_pass_through_unchanged():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "64", "--answers", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    (line,) = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert line["checks"] == {"equal": True, "passed_through": True}
    assert line["pass"] is True and done.returncode == 0
