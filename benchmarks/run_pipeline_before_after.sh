#!/usr/bin/env bash
# The step-pipeline change side by side with the build before it, on one machine, alternating:
#   BASE=<worktree of the commit before> benchmarks/run_pipeline_before_after.sh [REPS]
# Each run is `banyan bench offline` (random 64 x 128 in / OUT out, plus --batch1 128/128) on the
# SmolLM2-shaped random model in DTYPE; JSON in benchmarks/results/pipeline-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-2}
DTYPE=${DTYPE:-float32}
OUT=${OUT:-32}
MODEL=.bench-models/smol-$DTYPE
[ -f "$MODEL/model.safetensors" ] || .venv/bin/python benchmarks/make_model.py "$MODEL" --dtype "$DTYPE"
ARGS="bench offline --disable-tqdm --model $PWD/$MODEL --workload random --num-requests 64 --input-len 128 --output-len $OUT --kv-cache-memory 2GiB --batch1"
for rep in $(seq 1 "$REPS"); do
  for mode in before overlap sequential; do
    case $mode in
      before) (cd "$BASE" && PYTHONPATH="$BASE" "$OLDPWD/.venv/bin/python" -m banyan.cli $ARGS --out "$OLDPWD/benchmarks/results/pipeline-$mode-$rep.json") ;;
      overlap) PYTHONPATH=$PWD .venv/bin/python -m banyan.cli $ARGS --overlap on --out "benchmarks/results/pipeline-$mode-$rep.json" ;;
      sequential) PYTHONPATH=$PWD .venv/bin/python -m banyan.cli $ARGS --overlap off --out "benchmarks/results/pipeline-$mode-$rep.json" ;;
    esac >/dev/null 2>&1
    sed -i "s#$PWD/##g" "benchmarks/results/pipeline-$mode-$rep.json"  # paths relative to the repo
    echo "$mode $rep done"
  done
done
