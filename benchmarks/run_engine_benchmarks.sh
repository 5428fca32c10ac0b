#!/usr/bin/env bash
# The engine-core and prefix-cache benchmarks recorded in docs/performance.md.
# Usage: benchmarks/run_engine_benchmarks.sh [MODEL_DIR_PREFIX]   (run on an otherwise idle machine)
# Builds the SmolLM2-135M-shaped random models if missing, then writes JSON to benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${1:-.bench-models/smol}
OUT=benchmarks/results
BANYAN=.venv/bin/banyan
mkdir -p "$OUT"
for dt in bfloat16 float32; do
  [ -f "$PREFIX-$dt/model.safetensors" ] || .venv/bin/python benchmarks/make_model.py "$PREFIX-$dt" --dtype $dt
done
run() { local name=$1; shift; echo "== $name"; $BANYAN bench offline --disable-tqdm --out "$OUT/$name.json" "$@" >/dev/null 2>"$OUT/$name.log"; }
B="--model $PREFIX-bfloat16"
run random-bf16 $B --workload random --num-requests 64 --input-len 128 --output-len 128 --batch1 --kv-cache-memory 2GiB
run random-fp32 --model "$PREFIX-float32" --workload random --num-requests 64 --input-len 128 --output-len 128 --batch1 --kv-cache-memory 2GiB
SP="--workload shared-prefix --groups 8 --prompts-per-group 8 --system-len 1024 --question-len 64 --output-len 64 --kv-cache-memory 4GiB"
run shared-prefix-8x8-on $B $SP
run shared-prefix-8x8-off $B $SP --no-prefix-cache
SP1="--workload shared-prefix --groups 1 --prompts-per-group 64 --system-len 1024 --question-len 32 --output-len 64 --kv-cache-memory 4GiB"
run shared-prefix-1x64-on $B $SP1
run shared-prefix-1x64-off $B $SP1 --no-prefix-cache
# Policy under memory pressure: the KV cache holds ~5 of the 8 system prompts at once.
SPP="--workload shared-prefix --groups 8 --prompts-per-group 8 --system-len 1024 --question-len 64 --output-len 64 --kv-cache-memory 160MiB"
run shared-prefix-8x8-small-kv-lpm $B $SPP --schedule-policy lpm
run shared-prefix-8x8-small-kv-fcfs $B $SPP --schedule-policy fcfs
MT="--workload multi-turn --conversations 8 --turns 4 --system-len 512 --question-len 64 --output-len 64 --kv-cache-memory 4GiB"
run multi-turn-on $B $MT
run multi-turn-off $B $MT --no-prefix-cache
.venv/bin/python benchmarks/summarize.py "$OUT"
