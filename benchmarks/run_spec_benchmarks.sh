#!/usr/bin/env bash
# Speculative decoding side by side in one run, on the real SmolLM2-135M-Instruct (the default
# model):  benchmarks/run_spec_benchmarks.sh   # then: python benchmarks/spec_report.py
# - batch 1 (one request at a time): grounded and chat workloads, none / ngram / draft, per dtype;
#   the draft is the target's own checkpoint quantized to int4 at load (--spec-draft-quantization),
#   the best same-tokenizer draft this machine has (a layer-truncated one, benchmarks/make_draft.py,
#   accepted nothing); DRAFT=DIR DRAFT_QUANT=none runs another.
# - under load: random 64 x 128/128, none / ngram (adaptive turn-off).
# JSON in benchmarks/results/${PREFIX}*.json (PREFIX default "spec-"; give another machine's set
# its own, e.g. PREFIX=spec-zen3-, so the figures the docs cite are not overwritten).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-3}
OUT=${OUT:-128}
DTYPES=${DTYPES:-"float32 bfloat16"}
TARGET=$(.venv/bin/python -c "from banyan.model_files import resolve_model_dir; print(resolve_model_dir(None))")
DRAFT=${DRAFT:-$TARGET}
DRAFT_QUANT=${DRAFT_QUANT:-int4}
PREFIX=${PREFIX:-spec-}

run() {
  local name=$1; shift
  .venv/bin/banyan bench offline --disable-tqdm "$@" --out "benchmarks/results/$PREFIX$name.json" >/dev/null 2>&1
  sed -i "s#$PWD/##g; s#$HOME/#~/#g" "benchmarks/results/$PREFIX$name.json"  # no machine paths
  echo "$name done"
}

for dtype in $DTYPES; do
  for workload in grounded chat; do
    for algo in none ngram draft; do
      extra=()
      [ "$algo" = draft ] && extra=(--spec-draft-model "$DRAFT" --spec-draft-quantization "$DRAFT_QUANT")
      run "$workload-$algo-$dtype" --dtype "$dtype" --workload "$workload" --num-requests "$N" \
        --output-len "$OUT" --max-running-requests 1 --speculative-algorithm "$algo" "${extra[@]}"
    done
  done
done
for algo in none ngram; do
  run "load-$algo-float32" --dtype float32 --workload random --num-requests 64 --input-len 128 \
    --output-len 128 --kv-cache-memory 2GiB --speculative-algorithm "$algo"
done
