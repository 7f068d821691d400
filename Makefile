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
# Keep compiled bytecode between runs, even where the environment sets PYTHONDONTWRITEBYTECODE (these machines do):
# without it every run compiles the package again and pytest rewrites every test file (16 s of a quick loop of 83 s).
# __pycache__/ is ignored by git.
export PYTHONDONTWRITEBYTECODE :=

.DEFAULT_GOAL := help
.PHONY: help install docs test test-quick test-slow test-site test-nbdev bench run preview export readme hooks clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(INSTALLED): settings.ini setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) -e '.[dev]'
	@touch $@

install: $(INSTALLED) ## create .venv and install the package with the pinned dev tools

docs: $(INSTALLED) ## build the site into _docs/ (Quarto if on PATH, else smalldocs)
	$(PY) tools/docs.py site

# One pytest run, two workers: each notebook runs once (its cells must not raise and its saved outputs must still be
# what it prints), beside the checks of the generated files and tests/. Workers run torch on one thread each.
PYTEST := $(PY) -m pytest -n auto --maxschedchunk 1

test: $(INSTALLED) ## notebooks (incl. slow cells), generated files, tests, coverage >= 95 %; not the tests marked slow
	$(PYTEST) -q -m 'not slow and not site' --cov=selfattn_nbdev --cov-report= --cov-fail-under=95

test-slow: $(INSTALLED) ## the tests marked slow: torch.compile, 4 ranks, a wheel, the site's links (CI runs them too)
	$(PYTEST) -q -m 'slow and not site'

test-quick: $(INSTALLED) ## the edit loop: make test without coverage, `#| slow` cells and tests marked slow or heavy
	$(PYTEST) -q --quick -m 'not slow and not heavy and not site'

# nbdev's own command, as a contributor types it: every notebook, several to a process, nbdev's worker count. Each
# worker runs torch on one thread: nbdev starts as many workers as there are cores, and two of torch's threads to a
# worker make them wait on each other (a notebook took 134 s that way instead of 14 s on a busy 2-core machine).
test-nbdev: $(INSTALLED) ## nbdev_test over every notebook (skips `#| slow` cells), several to a process, timed; CI runs it
	$(call in_scratch,OMP_NUM_THREADS=1 $(BIN)/nbdev_test --timing)

test-site: $(INSTALLED) ## build the site, serve it on 127.0.0.1 and walk every page in headless Chromium
	$(PY) -m pytest -m site -s -q

bench: $(INSTALLED) ## time the attention paths against PyTorch's, generation, eager and compiled decode, GQA/window/RoPE, tiled and masked memory, every checkpoint family against transformers, loading memory, any model through transformers beside sdpa, decoding on a CPU against its memory limit, what reading the columns seen gains and a graph of any capacity costs, how its products share two threads, by the kernel of each number of rows and over a session of calls (~85 min; llama.cpp too with LLAMACPP_PYTHON=<a Python with llama-cpp-python and gguf>)
	$(PY) bench/benchmark.py
	$(PY) bench/generation.py
	$(PY) bench/decode.py
	$(PY) bench/modern.py
	$(PY) bench/memory_tiled.py
	$(PY) bench/masks.py
	$(PY) bench/families.py
	$(PY) bench/load_memory.py
	$(PY) bench/hf_route.py
	$(PY) bench/cpu_decode.py $(if $(LLAMACPP_PYTHON),--llamacpp-python $(LLAMACPP_PYTHON))
	$(PY) bench/decode_reads.py
	$(PY) bench/any_capacity.py
	$(PY) bench/decode_guards.py
	$(PY) bench/row_loop.py
	$(PY) bench/thread_split.py $(if $(LLAMACPP_PYTHON),--llamacpp-python $(LLAMACPP_PYTHON))
	$(PY) bench/row_kernels.py
	$(PY) bench/auto_compile.py
	$(call run_nbs,nbs/08_performance.ipynb nbs/09_modern.ipynb nbs/10_masks.ipynb nbs/11_kernels.ipynb nbs/11_tiled.ipynb nbs/14_checkpoints.ipynb nbs/17_transformers.ipynb nbs/95_measurements.ipynb)

# Run notebooks top to bottom from their own folder with nbdev's engine (execnb's exec_nb), stopping at the first
# cell that raises, and save them with their fresh outputs, cleaned.
run_nbs = $(call in_scratch,for nb in $(1); do \
	  (cd "$$(dirname $$nb)" && $(abspath $(BIN))/exec_nb "$$(basename $$nb)" --dest "$$(basename $$nb)" --exc_stop) \
	  && $(BIN)/nbdev_clean --fname "$$nb" && echo "ran and saved $$nb" || exit 1; \
	done)

# Run a command with TMPDIR in a folder of its own, removed after it: the pages save checkpoints to temporary folders
# (tempfile.mkdtemp(), as a reader would), which would otherwise pile up in /tmp run after run.
in_scratch = @scratch=$$(mktemp -d) && trap 'rm -rf "$$scratch"' EXIT && export TMPDIR="$$scratch" && $(1)

run: $(INSTALLED) ## run notebooks and save their outputs: make run NB="nbs/03_causal.ipynb nbs/04_multihead.ipynb"
	@test -n "$(NB)" || { echo 'name the notebooks: make run NB="nbs/03_causal.ipynb ..."'; exit 1; }
	$(call run_nbs,$(NB))

preview: $(INSTALLED) ## serve the site on localhost and rebuild it on every change
	$(PY) tools/docs.py preview

export: $(INSTALLED) ## after editing notebooks: clean them, export the package, render README.md
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export
	$(PY) tools/docs.py readme

readme: $(INSTALLED) ## render README.md from nbs/index.ipynb
	$(PY) tools/docs.py readme

# nbdev's hooks call nbdev_trust and nbdev_merge from PATH: `hooks` points them at .venv's, activated or not
hooks: $(INSTALLED) ## git hooks: clean notebooks on save and commit, keep the package in sync, merge notebooks
	$(BIN)/nbdev_install_hooks
	install -m 755 tools/pre-commit .git/hooks/pre-commit
	printf '#!/bin/bash\n"%s/$(BIN)/nbdev_trust"\n' "$(CURDIR)" > .git/hooks/post-merge
	git config --local merge.nbdev-merge.driver "$(CURDIR)/$(BIN)/nbdev_merge %O %A %B %P"

clean: ## remove built files (keeps .venv)
	rm -rf _docs _proc build dist *.egg-info .pytest_cache
