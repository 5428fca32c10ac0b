#!/bin/bash
# Issue 20's GPU check, for a machine with a CUDA GPU; ~10 minutes (each stage time-limited);
# prints progress.
#   1. Python: the machine's own torch (a CUDA build), triton, transformers, tokenizers; the
#      rest of Banyan's dependencies from wheels in .whl/ when there are any (a GPU machine
#      without internet: make them beforehand with benchmarks/gpu/fetch_wheels.sh). Where pip
#      can reach an index, `make install-test TORCH_SPEC="torch==2.13.0 --index-url
#      https://download.pytorch.org/whl/cu128"` installs everything instead.
#   2. The CUDA-marked tests of the files that have them, then the Triton, CUDA-graph and
#      transformers-on-CUDA tests whole. Each stage has its own time limit and a failing stage
#      does not stop the next: one run reports everything.
#   3. benchmarks/gpu/bench.py: random 64 x 128/128 and batch-1 on two random-weight models,
#      where a batch-1 step's time goes, and the fused element-wise kernels off and on
#      (batch1_variants.py); then benchmarks/gpu/low_precision.py: int8 / int4 weights and an
#      fp8 KV cache against bf16 on the 1.2B shape.
# Writes env.txt, gpu-tests.log, gpu-check.json, gpu-check.md, gpu-low-precision.json / .md
# and a profile table per model
# into $OUT (or benchmarks/results).
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
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv 2>&1; nproc; $PY --version
  $PY -c "import torch, triton, transformers as t; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', t.__version__)"
} 2>&1 | tee "$DIR/env.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
PYTEST="$PY -m pytest -q -p no:cacheprovider -rfE --maxfail=8 --timeout=120"
# four test processes share the GPU where pytest-xdist is installed (the CPU-side
# transformers references and Triton's compiles are most of the time)
$PY -c "import xdist" 2>/dev/null && PYTEST="$PYTEST -n 4"
echo "== CUDA-marked tests ($(elapsed))"
timeout 120 $PYTEST -m cuda tests/test_engine.py tests/test_models.py tests/test_sampler.py \
  tests/test_quant.py tests/test_cascade_attention.py tests/test_kv_sizing.py \
  > "$DIR/gpu-tests.log" 2>&1
tests=$?
tail -12 "$DIR/gpu-tests.log"
echo "== Triton, CUDA-graph and transformers-on-CUDA tests ($(elapsed))"
timeout 140 $PYTEST tests/test_triton_attention.py tests/test_cuda_graph.py \
  tests/test_cuda_reference.py tests/test_triton_fused.py tests/test_triton_quant_linear.py \
  >> "$DIR/gpu-tests.log" 2>&1
[ $? -eq 0 ] || tests=1
tail -12 "$DIR/gpu-tests.log"
echo "== benchmark ($(elapsed))"
timeout 300 $PY benchmarks/gpu/bench.py --out-dir "$DIR" --diagnose 2>&1 | grep -v "nanobind\|leaked"
bench=${PIPESTATUS[0]}
echo "== low precision ($(elapsed))"
timeout 150 $PY benchmarks/gpu/low_precision.py --out-dir "$DIR" 2>&1 | grep -v "nanobind\|leaked"
low=${PIPESTATUS[0]}
echo "== done in $(elapsed): tests exit $tests, benchmark exit $bench, low precision exit $low"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$low" -eq 0 ]
