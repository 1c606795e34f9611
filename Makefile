# windowgpt: set-up, demo, tests and reproduction targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch is installed first so that set-up never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO ?= demo-out
# Commands that run on the machine's GPUs: the project's environment when there is one.
RUN_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)

.PHONY: help setup demo test test-fast test-gpu clean

help:
	@echo "make demo       set up, then prepare -> train -> export -> quantize -> eval -> eval-ttt -> generate"
	@echo "                on a tiny model (CPU, about a minute and a half on 2 cores)"
	@echo "make test       set up, then run the CPU test suite (TEST_WORKERS processes, default: one per core)"
	@echo "make test-fast  the quick subset of the CPU tests (no test marked slow), for iterating"
	@echo "make test-gpu   the tests that need a CUDA device"
	@echo "make setup      the project's environment in $(VENV), with the tests' extra"
	@echo "make clean      remove the demo's output and pytest's cache"
	@echo "make record     reproduce the record run: DATA=... NPROC=8 OUT=... (docs/record.md)"
	@echo "make smoke-gpu  the record chain on one GPU in a few minutes"

# The package and its dependencies: all that the demo needs.
$(VENV)/.package: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

# The tests' extra (pytest, hypothesis, and triton for the kernels' interpreter tests).
$(VENV)/.installed: $(VENV)/.package
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# One pytest process per core, each with one torch thread (tests/conftest.py).
TEST_WORKERS ?= auto

test: setup
	$(PY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -m "not gpu and not slow" -n $(TEST_WORKERS) --dist loadfile

test-gpu:
	$(RUN_PYTHON) -m pytest -q -m gpu

demo: $(VENV)/.package
	rm -rf $(DEMO)
	$(VENV)/bin/windowgpt prepare data/demo/gutenberg_1mb.jsonl --out $(DEMO)/data --vocab-size 1024 --val-fraction 0.05
	$(VENV)/bin/windowgpt train --preset tiny --data $(DEMO)/data --out $(DEMO)/run
	$(VENV)/bin/windowgpt export $(DEMO)/run --out $(DEMO)/export
	$(VENV)/bin/windowgpt quantize $(DEMO)/export --out $(DEMO)/model.ptz --gptq
	$(VENV)/bin/windowgpt eval $(DEMO)/model.ptz --data $(DEMO)/data
	$(VENV)/bin/windowgpt eval-ttt $(DEMO)/model.ptz --data $(DEMO)/data
	$(VENV)/bin/windowgpt generate $(DEMO)/model.ptz --prompt "It was a dark night, and" --max-new-tokens 48 --temperature 0

clean:
	rm -rf $(DEMO) .pytest_cache

# --- Reproducing the reference's record run (GPU machines) -----------------------------
# These use the project's .venv when it exists (with a CUDA build of torch: see README),
# else the machine's python3: `make record DATA=... NPROC=8 OUT=...`.
# Each stage writes its own file under OUT and reruns only when its input is newer, so
# `make $(OUT)/eval.json` reruns one stage. Training runs once per OUT: an interrupted
# run is resumed; to train again with other settings, choose another OUT. Each stage's
# whole command is timed into OUT/STAGE.wall_s, and `windowgpt report` ends the target:
# OUT/record.json and OUT/README.md, exit 1 when the run breaks a rule.
# Every record stage runs from OUT/code.pyz, the packed code (`windowgpt pack`) that the
# reports count. It is packed once per OUT, before training; delete it to pack again.
# PACK_FLAGS=--strip packs the modules without comments and docstrings (about 30% fewer bytes);
# PACK_FLAGS="--strip --lzma" also puts them into one lzma stream (a third fewer again).
PACK_FLAGS ?=
WINDOWGPT ?= $(RUN_PYTHON) -m windowgpt_cli
CODE = $(OUT)/code.pyz
RUN_CODE = $(RUN_PYTHON) $(CODE)
NPROC ?= 8
TORCHRUN ?= $(RUN_PYTHON) -m torch.distributed.run --standalone --nproc_per_node $(NPROC)
# The stages that run one process per GPU: under torchrun on several GPUs; on one, a plain
# process (rank 0 of 1), which spares torchrun's agent its seconds of start-up per command.
RUN_RANKS = $(if $(filter 1,$(NPROC)),$(RUN_CODE),$(TORCHRUN) $(CODE))
DATA ?= data/fineweb10B_sp1024
OUT ?= record-out
# The reference's defaults, plus what its comments recommend and the record used: windows
# of 512 tokens with 4 sink tokens on layers 2,4,6,8,10, and 600 s of training of which
# the last 14 s (--gptq-reserve-seconds) collect GPTQ's Hessians from training batches.
# The last two flags undo windowgpt's two departures from the reference's schedule (EMA
# warm-up, warm-down capped at half the wallclock budget).
# Mixed sequence lengths, if wanted: --train-seq-len-long 6144 --num-gpus-long N.
# The record's model: windows of 512 with 4 sink tokens on five layers (empty: full attention).
RECORD_MODEL_FLAGS ?= --window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10
RECORD_FLAGS ?= $(RECORD_MODEL_FLAGS) \
	--max-wallclock-seconds 600 --use-gptq --no-ema-warmup --warmdown-max-fraction 1.0
EVAL_TTT_FLAGS ?=
# smoke-gpu: the same chain on one GPU in a few minutes (later flags win). A warm-down of
# 60 steps and the EMA's warm-up keep 200 steps from ending near the initialization.
# Without a wallclock cap, calibration follows training (and is timed as training).
SMOKE_FLAGS ?= --iterations 200 --train-batch-tokens 131072 --max-wallclock-seconds 0 --warmdown-iters 60 \
	--ema-warmup
SMOKE_OUT ?= smoke-out

.PHONY: record smoke-gpu

record: $(OUT)/eval.json $(OUT)/eval-ttt.json
	$(WINDOWGPT) report $(OUT)

smoke-gpu:
	$(MAKE) record NPROC=1 OUT=$(SMOKE_OUT) "RECORD_FLAGS=$(RECORD_FLAGS) $(SMOKE_FLAGS)" \
		"EVAL_TTT_FLAGS=--ttt-epochs 1 $(EVAL_TTT_FLAGS)"

# `start=$$(date +%s.%N); COMMAND && $(call wall_s,NAME)` writes COMMAND's seconds to OUT/NAME.wall_s.
wall_s = echo "$$start $$(date +%s.%N)" | awk '{printf "%.3f\n", $$2 - $$1}' > $(OUT)/$(1).wall_s

$(CODE):
	$(WINDOWGPT) pack $(PACK_FLAGS) --out $@

# Every stage that reads DATA checks it against its manifest; shards made elsewhere (the
# reference's FineWeb download) get one here, with DATA/tokenizer.model or TOKENIZER=MODEL
# (copied into DATA).
TOKENIZER ?=
$(DATA)/manifest.json:
	$(WINDOWGPT) prepare --index $(DATA) $(if $(TOKENIZER),--tokenizer $(TOKENIZER))

# summary.json is written when training finishes; a checkpoint without it is resumed.
# (Packing again does not retrain: the code is an order-only prerequisite here.)
$(OUT)/train/summary.json: | $(CODE) $(DATA)/manifest.json
	mkdir -p $(OUT) && start=$$(date +%s.%N) && \
	if [ -f $(OUT)/train/checkpoint.pt ]; then \
		$(RUN_RANKS) train --data $(DATA) --out $(OUT)/train --resume; \
	else \
		$(RUN_RANKS) train --data $(DATA) --out $(OUT)/train $(RECORD_FLAGS); \
	fi && $(call wall_s,train)

# The export carries the Hessians training collected; quantize uses them (no --data).
$(OUT)/export/model.safetensors: $(OUT)/train/summary.json $(CODE)
	$(RUN_CODE) export $(OUT)/train --out $(OUT)/export

$(OUT)/model.ptz: $(OUT)/export/model.safetensors $(CODE)
	start=$$(date +%s.%N) && $(RUN_CODE) quantize $(OUT)/export --out $@ --gptq && $(call wall_s,quantize)

$(OUT)/eval.json: $(OUT)/model.ptz $(CODE)
	start=$$(date +%s.%N) && \
	$(RUN_RANKS) eval $< --data $(DATA) --stride 64 --json > $@.tmp && $(call wall_s,eval)
	mv $@.tmp $@

$(OUT)/eval-ttt.json: $(OUT)/model.ptz $(CODE)
	start=$$(date +%s.%N) && \
	$(RUN_RANKS) eval-ttt $< --data $(DATA) --json $(EVAL_TTT_FLAGS) > $@.tmp && $(call wall_s,eval-ttt)
	mv $@.tmp $@
