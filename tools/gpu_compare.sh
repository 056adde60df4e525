#!/usr/bin/env bash
# The digits comparison at convergence for a GPU window: `dbsn-compare --data digits --tune` for every
# method on both backbones (structure_net, resnet18), P processes at once on the machine's cores, within
# BUDGET seconds all told (joins included), by `python -m dbsn.tools.compare_parallel` (see its --help).
#   OUT=gpu_compare BUDGET=300 tools/gpu_compare.sh [compare_parallel options ...]
# The comparison's folder is $WORK (default ./compare_out, in the checkout): <backbone>/ each backbone's
# comparison (comparison.md, comparison.json, report/), parts/ the processes' runs, logs/, summary.md,
# status.json. What comes back from a machine that sends only a few files goes to $OUT (default $WORK):
#   summary.md          each backbone's table, the unconverged methods, what did not finish
#   status.json         every process's state and exit status
#   compare.tar.gz      $WORK's comparisons, logs and finished runs, without checkpoints or run figures
#   environment.txt, nvidia_smi.txt
# Exit status: 0 all finished; 124 the budget stopped some (the finished ones are in the tables); 1 a failure.
# To continue in a later window: unpack compare.tar.gz into ./compare_out, carry compare_out, run again.
# On a CPU, in a minute: BUDGET=120 tools/gpu_compare.sh --device cpu --processes 2 --backbones structure_net
#   --methods map,mc_dropout --epochs 1 --lr-grid 0.1 --samples 2 --subset 128 --join-seconds 40
set -u
WORK=${WORK:-./compare_out}
OUT=${OUT:-$WORK}
BUDGET=${BUDGET:-300}
mkdir -p "$WORK" "$OUT"
WORK=$(cd "$WORK" && pwd)
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
if ! timeout 90 "$PY" -c "import dbsn.tools.compare, torch, matplotlib.font_manager; print('dbsn from', dbsn.__file__, '| torch',
  torch.__version__, '| CUDA', torch.cuda.is_available())" > "$OUT/environment.txt" 2>&1; then
  echo "gpu_compare.sh: dbsn does not import with $PY (see $OUT/environment.txt): carry .whl/ for Hydra" >&2
  cat "$OUT/environment.txt" >&2
  exit 1
fi
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
fi
# the budget counts from here: the start above (matplotlib's font cache built once, not by 16 processes) is outside it
"$PY" -m dbsn.tools.compare_parallel --out "$WORK" --budget "$BUDGET" --pack "$OUT/compare.tar.gz" "$@"
rc=$?
if [ "$OUT" != "$WORK" ]; then
  cp "$WORK/summary.md" "$WORK/status.json" "$OUT/" 2> /dev/null
fi
echo "gpu_compare.sh: exit status $rc (0: all finished; 124: the budget stopped some; 1: a failure); $OUT/summary.md"
exit $rc
