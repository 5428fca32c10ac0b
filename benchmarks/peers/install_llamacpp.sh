#!/usr/bin/env bash
# llama.cpp for the low-precision side by side (#16): llama-cpp-python built from source in its
# own virtual environment, and the shipped SmolLM2 Q4_1 file requantized to Q8_0 and Q4_0 (the
# formats #16 compares Banyan's int8 / int4 with).
#
#   benchmarks/peers/install_llamacpp.sh   # -> ${BANYAN_PEERS_DIR:-~/.cache/banyan-peers}/llamacpp
#                                          #    and .../smol-Q8_0.gguf, .../smol-Q4_0.gguf
#
# The ISA flags are spelled out from /proc/cpuinfo instead of -DGGML_NATIVE=ON: a native build
# died with "Illegal instruction" on the Intel AMX Xeon (PEERS.md). About 5-10 minutes on 2
# cores. Idempotent: a second run only checks the import and the files.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS_DIR=${BANYAN_PEERS_DIR:-$HOME/.cache/banyan-peers}
VENV=$PEERS_DIR/llamacpp
PYTHON=${PYTHON:-python3}
SPEC=${LLAMACPP_SPEC:-llama-cpp-python==0.3.36}
mkdir -p "$PEERS_DIR"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  has() { grep -qw "$1" /proc/cpuinfo; }
  onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
  args="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2)"
  args+=" -DGGML_FMA=$(onoff fma) -DGGML_F16C=$(onoff f16c) -DGGML_AVX512=$(onoff avx512f)"
  args+=" -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)"
  # (no GGML_AMX_*: built with them, llama.cpp died with SIGILL at its first forward on an AMX
  # Xeon, family 6 model 207, 2026-12-06; PEERS.md's recipe for that Xeon leaves them off)
  echo "CMAKE_ARGS=$args"
  "$VENV/bin/python" -m pip install numpy
  CMAKE_ARGS="$args" "$VENV/bin/python" -m pip install --no-cache-dir "$SPEC"
fi
SOURCE=$(.venv/bin/python -c \
  "from banyan.models.gguf_loader import default_model_file as f; print(f())")
# Requantizing from Q4_1 (allow_requantize) keeps the weights the shipped file holds: the same
# values Banyan's int8 / int4 quantize at load from its dense conversion of that file.
"$VENV/bin/python" - "$SOURCE" "$PEERS_DIR" <<'PY'
import ctypes, os, sys
import llama_cpp

source, out_dir = sys.argv[1], sys.argv[2]
for name, ftype in (("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0),
                    ("Q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
    out = os.path.join(out_dir, f"smol-{name}.gguf")
    if not os.path.exists(out):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        rc = llama_cpp.llama_model_quantize(source.encode(), (out + ".part").encode(),
                                            ctypes.byref(params))
        if rc != 0:
            sys.exit(f"llama_model_quantize {name}: {rc}")
        os.replace(out + ".part", out)
    print(f"{name}: {out} ({os.path.getsize(out) / 2**20:.0f} MiB)")
print(f"llama-cpp-python {llama_cpp.__version__} ok")
PY
