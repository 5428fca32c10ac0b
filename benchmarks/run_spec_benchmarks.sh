#!/usr/bin/env bash
# Speculative decoding side by side in one run, on the real SmolLM2-135M-Instruct (the default
# model) and a layer-truncated draft of it (benchmarks/make_draft.py):
#   benchmarks/run_spec_benchmarks.sh            # then: python benchmarks/spec_report.py
# - batch 1 (one request at a time): grounded and chat workloads, none / ngram / draft, per dtype;
# - under load: random 64 x 128/128, none / ngram (adaptive turn-off).
# JSON in benchmarks/results/spec-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-3}
OUT=${OUT:-128}
DTYPES=${DTYPES:-"float32 bfloat16"}
KEEP=${KEEP:-0-6,29}
TARGET=$(.venv/bin/python -c "from banyan.model_files import resolve_model_dir; print(resolve_model_dir(None))")
DRAFT=.bench-models/draft-$KEEP
[ -f "$DRAFT/model.safetensors" ] || .venv/bin/python benchmarks/make_draft.py "$TARGET" "$DRAFT" --keep "$KEEP"

run() {
  local name=$1; shift
  .venv/bin/banyan bench offline --disable-tqdm "$@" --out "benchmarks/results/spec-$name.json" >/dev/null 2>&1
  sed -i "s#$PWD/##g; s#$HOME/#~/#g" "benchmarks/results/spec-$name.json"  # no machine paths
  echo "$name done"
}

for dtype in $DTYPES; do
  for workload in grounded chat; do
    for algo in none ngram draft; do
      extra=()
      [ "$algo" = draft ] && extra=(--spec-draft-model "$DRAFT")
      run "$workload-$algo-$dtype" --dtype "$dtype" --workload "$workload" --num-requests "$N" \
        --output-len "$OUT" --max-running-requests 1 --speculative-algorithm "$algo" "${extra[@]}"
    done
  done
done
for algo in none ngram; do
  run "load-$algo-float32" --dtype float32 --workload random --num-requests 64 --input-len 128 \
    --output-len 128 --kv-cache-memory 2GiB --speculative-algorithm "$algo"
done
