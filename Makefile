# One-command set-up: every target creates the environment it needs (.venv) on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: env train test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -c "import torch, torchvision; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	touch $(STAMP)

env: $(STAMP)

## The main job: DBSN on the embedded digits data, CPU, a few minutes; prints the test metrics.
train: $(STAMP)
	$(PY) train.py experiment=quick

## The test suite (CI runs this through .ci/run).
test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

## Speed and memory ratios, measured in one run on this machine.
bench: $(STAMP)
	$(PY) -m dbsn.bench

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
