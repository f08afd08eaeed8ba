"""scripts/check_target_image.py (`make images-check`, which builds the target image: not run here) runs as a
module from the checkout's root, like the other scripts: loading it leaves sys.path alone."""

from __future__ import annotations

import runpy
import sys


def test_it_loads_as_a_module_of_the_checkout_without_touching_sys_path(monkeypatch):
    before = list(sys.path)
    monkeypatch.setattr(sys, "path", list(before))
    script = runpy.run_module("scripts.check_target_image")  # as `python -m`, but not run as __main__
    assert sys.path == before
    assert callable(script["main"])
