#!/bin/bash
# Issue 20's GPU check, for a machine with a CUDA GPU; fits in 8 minutes, prints progress.
#   1. Python: the machine's own torch (a CUDA build), triton, transformers, tokenizers; the
#      rest of Banyan's dependencies from wheels in .whl/ when there are any (a GPU machine
#      without internet: make them beforehand with benchmarks/gpu/fetch_wheels.sh). Where pip
#      can reach an index, `make install-test TORCH_SPEC="torch==2.13.0 --index-url
#      https://download.pytorch.org/whl/cu128"` installs everything instead.
#   2. The CUDA-marked tests of the files that have them, plus the Triton and CUDA-graph tests.
#   3. benchmarks/gpu/bench.py: random 64 x 128/128 and batch-1 on two random-weight models.
# Writes gpu-tests.log, gpu-check.json and gpu-check.md into $OUT (or benchmarks/results).
#   benchmarks/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }
if compgen -G ".whl/*.whl" > /dev/null; then
  echo "== installing $(ls .whl/*.whl | wc -l) carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/banyan-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/banyan-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 2
echo "== CUDA tests ($(elapsed))"
timeout 240 $PY -m pytest -q -p no:cacheprovider -x -m "cuda" \
  tests/test_engine.py tests/test_models.py tests/test_sampler.py tests/test_quant.py \
  tests/test_cascade_attention.py 2>&1 | tee "$DIR/gpu-tests.log" | tail -15
tests=${PIPESTATUS[0]}
for extra in tests/test_triton_attention.py tests/test_cuda_graph.py; do
  [ -f "$extra" ] || continue
  timeout 120 $PY -m pytest -q -p no:cacheprovider -x "$extra" 2>&1 | tee -a "$DIR/gpu-tests.log" \
    | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || tests=1
done
echo "== benchmark ($(elapsed))"
timeout 240 $PY benchmarks/gpu/bench.py --out-dir "$DIR"
bench=$?
echo "== done in $(elapsed): tests exit $tests, benchmark exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
