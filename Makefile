# Two entry points: `make demo` (the main job on a real local cluster) and
# `make test`. Both create .venv and install the project from its own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvfs-installed

.PHONY: setup demo test test-unit bench stubs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned: an unpinned one pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/kvfs demo

test: setup
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/kvfs-bench io

stubs: setup
	$(BIN)/python -m kvfs.proto.generate

clean:
	rm -rf $(VENV) build dist *.egg-info
