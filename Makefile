# One-command set-up: every target creates the environment it needs (.venv) on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: env lint train evaluate test test-fast bench bench-gpu bench-gpu-smoke compare-gpu docs clean

## uv installs the same pinned versions as pip (compared package by package) in a fraction of the time
## (docs/performance.md); pip does it where uv cannot be had.
## --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (as on the
## development machine and CI) every process would compile torch, Lightning and SciPy again at import.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	( $(PY) -m pip install --quiet uv && $(PY) -m uv pip install --quiet --compile-bytecode --python $(PY) -c constraints.txt -e ".[dev]" ) \
		|| $(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -c "import torch, torchvision; print('torch', torch.__version__, '| torchvision', torchvision.__version__)"
	touch $(STAMP)

env: $(STAMP)

## The main job: DBSN on the embedded digits data, CPU, a few minutes; prints the test metrics.
train: $(STAMP)
	$(PY) train.py experiment=quick

## The evaluation suite on the newest `make train` run that has a checkpoint, into <run>/evaluation: OOD detection
## against natural-photo patches (S = 30; OpenOOD's post-hoc scores on the first 5 members) and FGSM/BIM
## attacks (first 100 test images, 10 samples: the paper uses all images and 30 samples; this keeps it to
## minutes on a CPU).
evaluate: $(STAMP)
	@run=$$(for d in $$(ls -td outputs/quick/runs/*/ 2>/dev/null); do [ -f "$${d}checkpoints/last.ckpt" ] && echo "$$d" && break; done); \
	if [ -z "$$run" ]; then echo "No make-train run with a checkpoint under outputs/quick/runs: run 'make train' first."; exit 1; fi; \
	$(PY) evaluate.py ckpt_path=$${run}checkpoints/last.ckpt evaluations=[ood,adversarial] ood=photos evaluations.ood.members=5 \
		evaluations.adversarial.max_examples=100 evaluations.adversarial.attack_samples=10 evaluations.adversarial.eval_samples=10 n_samples=30

## The lint and format gate (ruff, settings in pyproject.toml); `make test` runs it first, so CI gates on it.
## After a merge: `$(PY) -m ruff check --fix . && $(PY) -m ruff format .`
lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

## The test suite (CI runs this through .ci/run): two workers, one thread each (two torch processes
## with default threads on two cores spin against each other), each test file on one worker (its
## module fixtures, the SLURM cluster among them, are made once), the longest files first (tests/conftest.py).
## compileall: the package's .pyc too, for the suite's many processes (it prints only a file that does not compile).
test: $(STAMP) lint
	$(PY) -m compileall -q src
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	$(PY) -m compileall -q src
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

## Speed and memory ratios, measured in one run on this machine.
bench: $(STAMP)
	$(PY) -m dbsn.tools.bench --suite step
	$(PY) -m dbsn.tools.bench
	$(PY) -m dbsn.tools.bench --suite field --backbone resnet18

## The GPU window: what only a GPU shows about the paper step (kernel profile, convolution forms, the
## nodes-only compile cold and warm, CUDA graphs on streams), at most 8 minutes, results and summary.md
## under $$OUT (default bench_out); bench-gpu-smoke runs the same script on this CPU, tiny, in seconds.
bench-gpu: $(STAMP)
	PY=$(PY) tools/gpu_window.sh

bench-gpu-smoke: $(STAMP)
	PY=$(PY) tools/gpu_window.sh --device cpu --tiny --compile-backend eager

## The digits comparison at convergence on a GPU machine's cores: dbsn-compare --tune, every method, both
## backbones, one process per core, within $$BUDGET seconds (default 300), results under $$OUT (compare_out).
compare-gpu: $(STAMP)
	PY=$(PY) tools/gpu_compare.sh

## The documentation site into site/: the docs/ pages and the API reference from the docstrings (mkdocs.yml),
## offline; --strict: a warning (a broken link or anchor, a docstring that does not parse) fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache site
