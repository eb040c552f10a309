# Set-up and launch. Every target installs what it needs into .venv first.
#   make train-local            train configs/default.yaml on this machine (NPROC=, CONFIG=, ARGS=)
#   make test                   the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
NPROC ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: venv dev train-local test lint clean-runs

# The marker files make re-runs instant; they are rebuilt when the pins change.
$(VENV)/.deps: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	@touch $@

$(VENV)/.dev: $(VENV)/.deps requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $@

venv: $(VENV)/.deps
dev: $(VENV)/.dev

train-local: venv
	$(PY) -m train.launch $(if $(NPROC),--nproc-per-node=$(NPROC)) -- --config $(CONFIG) $(ARGS)

test: dev
	$(PY) -m pytest $(PYTEST_ARGS)

lint: dev
	$(VENV)/bin/ruff check train tests bench

clean-runs:
	rm -rf runs
