#!/usr/bin/env bash
# Two replicas behind the router on a shared-prefix workload: cache_aware, round_robin, and
# round_robin with both replicas joined to one Mooncake store (--hicache-backend mooncake), so a
# system prompt one replica computed is loaded by the other. One run each, on an idle machine.
# Usage: benchmarks/run_tier_router_benchmark.sh [MODEL] [DTYPE]   (default: the real SmolLM2, float32)
# Each replica gets one thread and a KV cache holding ~10 of the 16 system prompts (as
# run_router_benchmark.sh), so under round robin a replica keeps only part of what it sees.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-}
DT=${2:-float32}
case $DT in float32) KV=256MiB ;; *) KV=128MiB ;; esac
OUT=benchmarks/results
BANYAN=.venv/bin/banyan
MASTER_BIN=$(dirname "$(readlink -f .venv/bin/python)")/mooncake_master
[ -x "$MASTER_BIN" ] || MASTER_BIN=.venv/bin/mooncake_master
TOK=${MODEL:-$(.venv/bin/python -c "from banyan.model_files import resolve_model_dir; print(resolve_model_dir(None))")}
mkdir -p "$OUT/logs"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT
wait_up() { for url in "$@"; do for _ in $(seq 180); do curl -sf "$url" >/dev/null && break; sleep 1; done; done; }
WL="--workload shared-prefix --groups 16 --prompts-per-group 4 --system-len 512 --question-len 64 --output-len 32 --concurrency 16 --disable-tqdm"
serve() {  # serve PORT EXTRA...
  local port=$1; shift
  $BANYAN serve ${MODEL:+--model "$MODEL"} --dtype "$DT" --port "$port" --num-threads 1 \
    --kv-cache-memory "$KV" --disable-tqdm "$@" >"$OUT/logs/tier-replica-$port.log" 2>&1 &
  pids+=($!)
}
bench() {  # bench NAME ROUTER_PORT
  echo "== $1"
  $BANYAN bench serve --base-url "http://127.0.0.1:$2" --tokenizer "$TOK" $WL --out "$OUT/tier-router-$1.json" \
    2>/dev/null | tail -22
}
# 1. no tier: cache_aware and round_robin over the same replicas
serve 30201; serve 30202
W="--worker http://127.0.0.1:30201 --worker http://127.0.0.1:30202"
$BANYAN route $W --policy cache_aware --port 30210 >"$OUT/logs/tier-router-ca.log" 2>&1 & pids+=($!)
$BANYAN route $W --policy round_robin --port 30220 >"$OUT/logs/tier-router-rr.log" 2>&1 & pids+=($!)
wait_up http://127.0.0.1:30201/health http://127.0.0.1:30202/health http://127.0.0.1:30210/health http://127.0.0.1:30220/health
bench cache_aware 30210
bench round_robin 30220
cleanup
# 2. fresh replicas sharing one Mooncake store, round robin
"$MASTER_BIN" --rpc_port=50151 --rpc_address=127.0.0.1 --metrics_port=50153 \
  --metrics_host=127.0.0.1 --enable_metric_reporting=false >"$OUT/logs/tier-master.log" 2>&1 &
pids+=($!)
wait_up http://127.0.0.1:50153/health
TIER="--hicache-backend mooncake --hicache-mooncake-master 127.0.0.1:50151 --hicache-size 1GiB"
serve 30201 $TIER; serve 30202 $TIER
$BANYAN route $W --policy round_robin --port 30220 >"$OUT/logs/tier-router-rr-store.log" 2>&1 & pids+=($!)
wait_up http://127.0.0.1:30201/health http://127.0.0.1:30202/health http://127.0.0.1:30220/health
bench round_robin_store 30220
for port in 30201 30202; do
  curl -s "http://127.0.0.1:$port/server_info" | .venv/bin/python -c \
    "import json,sys; print($port, json.load(sys.stdin)['hicache'])"
done
