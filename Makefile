# Two commands on a fresh machine: `make demo` (the main job end to end) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; on a GPU cluster set e.g. TORCH_SPEC="torch==2.13.0".
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml

export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test bench clean

install: $(STAMP)

# torch first, then DeepSpeed without build isolation (it builds against the installed torch),
# then the project (editable) with the rest of its dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation deepspeed
	$(PY) -m pip install -q -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) launch/demo.py --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/prepare_data.py

clean:
	rm -rf runs
