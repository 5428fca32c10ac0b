#!/usr/bin/env bash
# Router benchmark: cache_aware vs round_robin over the same two replicas, alternating runs.
# Usage: [CONCURRENCY=16] [REPLICAS=2] [KV=256MiB] benchmarks/run_router_benchmark.sh [MODEL_DIR] [REPS]
# (on an idle machine). Each replica gets one thread and a KV cache that holds a little more than
# its share of the 16 system prompts under cache_aware routing (256 MiB: ~10 of 1,088 tokens),
# so where a group's requests land decides whether its prefix is reused. With more replicas
# than cores they share the cores (REPLICAS=4 KV=128MiB: ~5 prompts each).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-.bench-models/smol-bfloat16}
REPS=${2:-1}
CONCURRENCY=${CONCURRENCY:-16}
REPLICAS=${REPLICAS:-2}
KV=${KV:-256MiB}
TAG=c$CONCURRENCY
[ "$REPLICAS" = 2 ] || TAG=$TAG-r$REPLICAS
OUT=benchmarks/results
BANYAN=.venv/bin/banyan
mkdir -p "$OUT/logs"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
ports=()
workers=()
for i in $(seq "$REPLICAS"); do
  port=$((30100 + i)); ports+=($port); workers+=(--worker "http://127.0.0.1:$port")
  $BANYAN serve --model "$MODEL" --port $port --num-threads 1 --kv-cache-memory "$KV" \
    --disable-tqdm >"$OUT/logs/replica-$port.log" 2>&1 & pids+=($!)
done
$BANYAN route "${workers[@]}" --policy cache_aware --port 30110 >"$OUT/logs/router-ca.log" 2>&1 &
pids+=($!)
$BANYAN route "${workers[@]}" --policy round_robin --port 30120 >"$OUT/logs/router-rr.log" 2>&1 &
pids+=($!)
for port in "${ports[@]}" 30110 30120; do
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done
for rep in $(seq "$REPS"); do
  for pair in cache_aware:30110 round_robin:30120; do
    name=${pair%%:*}; port=${pair##*:}
    echo "== $name (rep $rep)"
    $BANYAN bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL" \
      --workload shared-prefix --groups 16 --prompts-per-group 8 --system-len 1024 \
      --question-len 64 --output-len 64 --concurrency "$CONCURRENCY" --disable-tqdm \
      --out "$OUT/router-$name-$TAG-$rep.json" 2>/dev/null | tail -25
  done
done
