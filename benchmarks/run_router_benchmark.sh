#!/usr/bin/env bash
# Router benchmark: cache_aware vs round_robin over the same two replicas, alternating runs.
# Usage: [CONCURRENCY=16] benchmarks/run_router_benchmark.sh [MODEL_DIR] [REPS]   (on an idle machine)
# Each replica gets one thread and a KV cache that holds about half of the 16 system prompts,
# so where a group's requests land decides whether its prefix is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-.bench-models/smol-bfloat16}
REPS=${2:-1}
CONCURRENCY=${CONCURRENCY:-16}
OUT=benchmarks/results
BANYAN=.venv/bin/banyan
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
for port in 30101 30102; do
  $BANYAN serve --model "$MODEL" --port $port --num-threads 1 --kv-cache-memory 256MiB \
    --disable-tqdm >"$OUT/replica-$port.log" 2>&1 & pids+=($!)
done
$BANYAN route --worker http://127.0.0.1:30101 --worker http://127.0.0.1:30102 --policy cache_aware \
  --port 30110 >"$OUT/router-ca.log" 2>&1 & pids+=($!)
$BANYAN route --worker http://127.0.0.1:30101 --worker http://127.0.0.1:30102 --policy round_robin \
  --port 30120 >"$OUT/router-rr.log" 2>&1 & pids+=($!)
for port in 30101 30102 30110 30120; do
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done
for rep in $(seq "$REPS"); do
  for pair in cache_aware:30110 round_robin:30120; do
    name=${pair%%:*}; port=${pair##*:}
    echo "== $name (rep $rep)"
    $BANYAN bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL" \
      --workload shared-prefix --groups 16 --prompts-per-group 8 --system-len 1024 \
      --question-len 64 --output-len 64 --concurrency "$CONCURRENCY" --disable-tqdm \
      --out "$OUT/router-$name-c$CONCURRENCY-$rep.json" 2>/dev/null | tail -25
  done
done
