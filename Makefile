# windowgpt: set-up, demo, tests and reproduction targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch is installed first so that set-up never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO ?= demo-out

.PHONY: help setup demo test test-gpu clean

help:
	@echo "make demo   - set up, then prepare -> train -> export -> quantize -> eval -> eval-ttt on a tiny model (CPU)"
	@echo "make test   - set up, then run the test suite (CPU)"
	@echo "make record / smoke-gpu - reproduce the reference's record run (see README)"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q -m "not gpu"

test-gpu:
	python3 -m pytest -q -m gpu

demo: setup
	rm -rf $(DEMO)
	$(VENV)/bin/windowgpt prepare data/demo/gutenberg_1mb.jsonl --out $(DEMO)/data --vocab-size 1024 --val-fraction 0.05
	$(VENV)/bin/windowgpt train --preset tiny --data $(DEMO)/data --out $(DEMO)/run
	$(VENV)/bin/windowgpt export $(DEMO)/run --out $(DEMO)/export
	$(VENV)/bin/windowgpt quantize $(DEMO)/export --out $(DEMO)/model.ptz --gptq --data $(DEMO)/data
	$(VENV)/bin/windowgpt eval $(DEMO)/model.ptz --data $(DEMO)/data
	$(VENV)/bin/windowgpt eval-ttt $(DEMO)/model.ptz --data $(DEMO)/data

clean:
	rm -rf $(DEMO) .pytest_cache
