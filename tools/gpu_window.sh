#!/usr/bin/env bash
# The GPU window: everything about the paper's training step that only a GPU shows, in at most
# 8 minutes (`make bench-gpu`). Run from anywhere; results under $OUT (default ./bench_out):
#   gpu_<part>.json   each part's results, rewritten as it measures (a part stopped by its time
#                     limit keeps what it had); <part>.log its output; progress.txt all parts' lines
#   summary.md        the tables of docs/performance.md, with the GPU and the date of this run
#   nvidia_smi.txt    the GPU; rc.txt each part's exit status (124: stopped by its limit)
#   compile_cache.bin the nodes-only compile's cache (the warm start loads it in a fresh process)
# The parts, in order of priority, each under its own `timeout` (seconds; 480 in all):
#   profile 80, forms 100, compile 150, compile (warm) 60, streams 75, summary 15
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
timeout 60 "$PY" -c "import dbsn, torch; print('dbsn from', dbsn.__file__, '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())" \
  > "$OUT/environment.txt" 2>&1
: > "$OUT/rc.txt"
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$OUT/nvidia_smi.txt" 2>&1
  nvidia-smi > "$OUT/nvidia_smi_full.txt" 2>&1
fi
PARTS=${PARTS:-profile forms compile compile_warm streams}
part() {  # part NAME SECONDS ARGUMENTS...: one part in a fresh process with fresh compiler caches
  local name=$1 limit=$2 cache
  shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  cache=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton \
    timeout -k 5 "$limit" "$PY" -m dbsn.tools.bench --suite gpu --out "$OUT" "$@" > "$OUT/$name.log" 2>&1
  echo "$name=$?" >> "$OUT/rc.txt"
  rm -rf "$cache"
}
part profile 80 --part profile "$@"
part forms 100 --part forms "$@"
part compile 150 --part compile "$@"
part compile_warm 60 --part compile --cache "$OUT/compile_cache.bin" "$@"
part streams 75 --part streams "$@"
timeout -k 5 15 "$PY" -m dbsn.tools.bench --suite gpu --part summary --out "$OUT"
echo "exit status: $(tr '\n' ' ' < "$OUT/rc.txt")(124: stopped by its time limit); tables: $OUT/summary.md"
