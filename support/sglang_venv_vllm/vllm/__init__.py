"""`vllm` in SGLang's environment (`.venv-sglang`), installed there by `make setup`: importing it fails.

`.venv-sglang` is layered over `.venv` (a .pth appends `.venv`'s site-packages), so `.venv`'s vLLM CPU build
would import there too, but with SGLang's pins shadowing vLLM's (compressed-tensors 0.18.0 for vLLM's 0.17.0,
apache-tvm-ffi, ...): a vLLM that runs on dependencies its own tests never ran it with. This package, found
first, stops that: vLLM's tests and servers run from `.venv` only (`make test` runs only the SGLang test
modules in `.venv-sglang`). SGLang's own CPU paths import no vLLM.
"""

raise ImportError(
    "vLLM does not run from .venv-sglang, where SGLang's pins shadow vLLM's (requirements-sglang.txt): run "
    "vLLM, its tests and `eagle3-target serve --engine vllm` from .venv"
)
