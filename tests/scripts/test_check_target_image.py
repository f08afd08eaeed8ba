"""scripts/check_target_image.py (`make images-check`, which builds the target image: not run here) runs as
`python -m scripts.check_target_image` from the checkout's root, as the Makefile runs it (the other scripts
run by path, `python scripts/X.py`): its imports of the checkout's `support` resolve that way alone, without
the script editing sys.path."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

from support.cluster.access import REPO


def test_it_runs_as_the_makefile_runs_it():
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "scripts.check_target_image", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "--engines" in done.stdout


def test_loading_it_leaves_sys_path_alone(monkeypatch):
    before = list(sys.path)
    monkeypatch.setattr(sys, "path", list(before))
    script = runpy.run_module("scripts.check_target_image")  # as `python -m`, but not run as __main__
    assert sys.path == before
    assert callable(script["main"])
