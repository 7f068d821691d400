# Two commands on a fresh clone: `make docs` and `make test`. Everything else is for contributors.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# Extra pip options, e.g. PIP_OPTS="--extra-index-url <a CPU-only torch index>" on a machine where plain
# `pip install torch==2.13.0` would fetch a CUDA build.
PIP_OPTS ?=
INSTALLED := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install docs test test-quick test-site bench run preview export readme hooks clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(INSTALLED): settings.ini setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) -e '.[dev]'
	@touch $@

install: $(INSTALLED) ## create .venv and install the package with the pinned dev tools

docs: $(INSTALLED) ## build the site into _docs/ (Quarto if on PATH, else smalldocs)
	$(PY) tools/docs.py site

test: $(INSTALLED) ## every check: sync, README, notebooks (incl. slow), site links, pytest
	$(PY) tools/check.py

test-quick: $(INSTALLED) ## the same, without notebook cells flagged slow
	$(PY) tools/check.py --quick

test-site: $(INSTALLED) ## build the site, serve it on 127.0.0.1 and walk every page in headless Chromium
	$(PY) tools/walk_site.py --build

bench: $(INSTALLED) ## time the attention paths against PyTorch's, generation with/without the KV cache, the tiny GPT with GQA/window/RoPE, tiled memory (~20 min)
	$(PY) bench/benchmark.py
	$(PY) bench/generation.py
	$(PY) bench/modern.py
	$(PY) bench/memory_tiled.py
	$(PY) tools/run_notebook.py nbs/07_tiled.ipynb nbs/08_modern.ipynb nbs/09_performance.ipynb

run: $(INSTALLED) ## run notebooks and save their outputs: make run NB="nbs/03_causal.ipynb nbs/04_multihead.ipynb"
	$(PY) tools/run_notebook.py $(NB)

preview: $(INSTALLED) ## serve the site on localhost and rebuild it on every change
	$(PY) tools/docs.py preview

export: $(INSTALLED) ## after editing notebooks: clean them, export the package, render README.md
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export
	$(PY) tools/docs.py readme

readme: $(INSTALLED) ## render README.md from nbs/index.ipynb
	$(PY) tools/docs.py readme

hooks: $(INSTALLED) ## git hooks: clean notebooks on save and commit, keep the package in sync, merge notebooks
	$(BIN)/nbdev_install_hooks
	install -m 755 tools/pre-commit .git/hooks/pre-commit

clean: ## remove built files (keeps .venv)
	rm -rf _docs _proc build dist *.egg-info .pytest_cache
