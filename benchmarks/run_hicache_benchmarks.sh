#!/usr/bin/env bash
# The KV tier (HiCache) benchmarks recorded in docs/performance.md, on an otherwise idle machine.
# Usage: [SKIP_RESTORE=1] benchmarks/run_hicache_benchmarks.sh [DTYPE]   (default float32; the
# real SmolLM2 model)
#  1. a 4k-token prefix restored from the file tier vs computed again (benchmarks/hicache_restore.py)
#  2. multi-turn chat whose KV is ~4x the pool: the prefix cache alone, with the file tier, and a
#     pool that holds everything (the bound), one after the other in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
DT=${1:-float32}
OUT=benchmarks/results
TIER=$(mktemp -d)
trap 'rm -rf "$TIER"' EXIT
[ "${SKIP_RESTORE:-0}" = 1 ] || .venv/bin/python benchmarks/hicache_restore.py --dtype "$DT" \
  --reps 2 --out "$OUT/hicache-restore-4k-$DT.json"
# SmolLM2-135M: 30 layers x 2 x 3 KV heads x 64 dims = 11,520 values per token.
case $DT in float32) BPT=46080 ;; *) BPT=23040 ;; esac
# 8 conversations x 4 turns end at ~1,090 tokens of context each: ~8,700 tokens of KV in all.
MT="--workload multi-turn --conversations 8 --turns 4 --system-len 512 --question-len 64 --output-len 64 --dtype $DT --disable-tqdm"
run() { local name=$1; shift; echo "== $name"; .venv/bin/banyan bench offline --out "$OUT/$name.json" "$@" >/dev/null 2>"$OUT/$name.log"; }
run "hicache-multi-turn-small-$DT" $MT --kv-cache-memory $((2200 * BPT))
run "hicache-multi-turn-tier-$DT" $MT --kv-cache-memory $((2200 * BPT)) --hicache-backend file --hicache-dir "$TIER"
run "hicache-multi-turn-large-$DT" $MT --kv-cache-memory $((12000 * BPT))
