"""Running a benchmark module as users do (``python -m bench.NAME ...``) and reading the JSON it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_bench(name: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """The JSON object `bench.<name>` printed; fails with its stderr's tail when it exited non-zero."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result
