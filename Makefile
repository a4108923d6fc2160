# Two commands on a fresh machine: `make demo` (the main job end to end) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first, on its own, so that it can come from PyTorch's own index:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu     # CPU-only wheels
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128   # CUDA 12.8 wheels
# Without it pip uses its configured index (PyPI's Linux wheels are CUDA builds). TORCH_SPEC
# picks the version: by default the release the test suite runs on (pyproject admits torch>=2.3,<3).
TORCH_SPEC      ?= torch==2.13.0
TORCH_INDEX_URL ?=
# Extras of the project (pyproject.toml): FAISS (cpu, or gpu = faiss-gpu-cu12 for CUDA 12; never
# both), the bundled default embedder (offline), .jsonl.zst and saved-dataset readers (corpora) and
# the test suite (dev). On a GPU machine:
#   make install EXTRAS=gpu,offline,corpora,dev TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
EXTRAS ?= cpu,offline,corpora,dev
STAMP  := $(VENV)/.installed
# DeepSpeed's requirement, read from pyproject.toml (the releases the test suite ran on).
DEEPSPEED_SPEC := $(shell sed -n 's/^ *"\(deepspeed[^"]*\)".*/\1/p' pyproject.toml)
CONFIG ?= configs/tiny.yaml

export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test bench clean

install: $(STAMP)

# torch first, then DeepSpeed without build isolation (it builds against the installed torch; the
# range pyproject.toml pins), then the project (editable) with the rest of its dependencies and EXTRAS.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)' $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q --no-build-isolation '$(DEEPSPEED_SPEC)'
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) launch/demo.py --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q --durations=10

bench: $(STAMP)
	$(PY) bench/prepare_data.py

clean:
	rm -rf runs
