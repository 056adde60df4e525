#!/usr/bin/env bash
# The GPU window: everything about the paper's training step that only a GPU shows, in at most
# 8 minutes (`make bench-gpu`). Run from anywhere; results under $OUT (default ./bench_out):
#   gpu_<part>.json   each part's results, rewritten as it measures (a part stopped by its time
#                     limit keeps what it had); <part>.log its output; progress.txt all parts' lines
#   summary.md        the tables of docs/performance.md, with the GPU and the date of this run
#   nvidia_smi.txt    the GPU; rc.txt each part's exit status (124: stopped by its limit)
#   compile_cache.bin the nodes-only compile's cache (the warm start loads it in a fresh process)
# The parts, in order of priority, each under its own `timeout` (seconds; 480 in all):
#   profile 75, forms 95, compile 165, compile (warm) 50, streams 75, summary 15 (+ 5 to start)
# and what a part leaves unused goes to the next of compile, compile (warm) and streams.
# (see `python -m dbsn.tools.bench --help` and dbsn.tools.bench.window). Extra arguments go to every
# part: `tools/gpu_window.sh --device cpu --tiny --compile-backend eager` is the CPU smoke test.
# PARTS="forms streams" runs only those (default: all; compile_warm is its own name).
set -u
OUT=${OUT:-./bench_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch" > /dev/null 2>&1 || PY=python3
# this checkout's code, wherever the environment's editable install points (a copied .venv)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 20 "$PY" -c "import dbsn, torch; print('dbsn from', dbsn.__file__, '| torch', torch.__version__,
  '| CUDA', torch.cuda.is_available())" \
  > "$OUT/environment.txt" 2>&1
: > "$OUT/rc.txt"
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
  nvidia-smi > "$OUT/nvidia_smi_full.txt" 2>&1
fi
PARTS=${PARTS:-profile forms compile compile_warm streams}
SPARE=0  # seconds left unused by the parts so far
part() {  # part NAME SECONDS TAKES_SPARE ARGUMENTS...: one part in a fresh process with fresh compiler caches
  local name=$1 limit=$2 takes=$3 cache start rc
  shift 3
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  if [ "$takes" = 1 ]; then limit=$((limit + SPARE)); SPARE=0; fi
  cache=$(mktemp -d)
  start=$SECONDS
  TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton \
    timeout -k 5 "$limit" "$PY" -m dbsn.tools.bench --suite gpu --out "$OUT" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name=$rc" >> "$OUT/rc.txt"
  echo "$name: exit $rc after $((SECONDS - start)) of $limit s" >> "$OUT/timing.txt"
  SPARE=$((SPARE + (limit > SECONDS - start ? limit - (SECONDS - start) : 0)))
  rm -rf "$cache"
}
: > "$OUT/timing.txt"
part profile 75 0 --part profile "$@"
part forms 95 0 --part forms "$@"
part compile 165 1 --part compile "$@"
part compile_warm 50 1 --part compile --cache "$OUT/compile_cache.bin" "$@"
part streams 75 1 --part streams "$@"
timeout -k 5 15 "$PY" -m dbsn.tools.bench --suite gpu --part summary --out "$OUT"
echo "exit status: $(tr '\n' ' ' < "$OUT/rc.txt")(124: stopped by its time limit); tables: $OUT/summary.md"
