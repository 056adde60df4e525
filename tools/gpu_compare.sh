#!/usr/bin/env bash
# The digits comparison at convergence for a GPU window: `dbsn-compare --data digits --tune` for every
# method on both backbones (structure_net, resnet18), P processes at once on the machine's cores, within
# BUDGET seconds all told (joins included), by `python -m dbsn.tools.compare_parallel` (see its --help).
#   OUT=gpu_compare BUDGET=300 tools/gpu_compare.sh [compare_parallel options ...]
# Results under $OUT (default ./compare_out):
#   summary.md          each backbone's table, the unconverged methods, what did not finish
#   <backbone>/         each backbone's comparison (comparison.md, comparison.json, report/, a folder per method)
#   status.json, logs/  every process's state, exit status and output; parts/ the processes' own folders
#   environment.txt, nvidia_smi.txt
# Exit status: 0 all finished; 124 the budget stopped some (the finished ones are in the tables); 1 a failure.
# Run again with the same $OUT (and settings) to continue: finished methods are kept, the others resume.
# On a CPU, the same in a minute: tools/gpu_compare.sh --device cpu --processes 2 --methods map,mc_dropout
#   --epochs 1 --lr-grid 0.1 --samples 2 --subset 128 --join-seconds 40 (BUDGET=120).
set -u
OUT=${OUT:-./compare_out}
BUDGET=${BUDGET:-300}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch" > /dev/null 2>&1 || PY=python3
# this checkout's code, wherever the environment's editable install points (a copied .venv)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the GPU machine has torch but not Hydra: its wheels travel in .whl/ (carry it), installed once per machine
if ! "$PY" -c "import hydra, omegaconf" > /dev/null 2>&1 && ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
elif [ -d /tmp/site ]; then
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ! timeout 60 "$PY" -c "import dbsn.tools.compare, torch; print('dbsn from', dbsn.__file__, '| torch',
  torch.__version__, '| CUDA', torch.cuda.is_available())" > "$OUT/environment.txt" 2>&1; then
  echo "gpu_compare.sh: dbsn does not import with $PY (see $OUT/environment.txt): carry .whl/ for Hydra" >&2
  cat "$OUT/environment.txt" >&2
  exit 1
fi
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
fi
# the budget counts from here; the interpreter's start above is outside it
exec "$PY" -m dbsn.tools.compare_parallel --out "$OUT" --budget "$BUDGET" "$@"
