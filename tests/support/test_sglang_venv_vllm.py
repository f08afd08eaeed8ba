"""The `vllm` of SGLang's environment (support/sglang_venv_vllm, installed into .venv-sglang by `make setup`).
.venv-sglang is layered over .venv, and where both have a package SGLang's pin wins: without this `vllm`,
`.venv`'s vLLM would import there on dependencies its own lock does not pin (compressed-tensors, when this was
written). That is why the guard exists; the test checks the guard, not the pins, which may converge. vLLM,
its tests and its servers run from .venv only."""

from __future__ import annotations

import subprocess

from support.cluster.access import REPO


def test_vllm_does_not_import_where_sglangs_pins_would_shadow_its_own():
    done = subprocess.run(
        [str(REPO / ".venv-sglang" / "bin" / "python"), "-c", "import vllm"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert (
        "ImportError: vLLM does not run from .venv-sglang, where SGLang's pins shadow vLLM's" in done.stderr
    )
