#!/bin/bash
# Wheels of Banyan's dependencies that the lent GPU machine's image lacks (it has torch,
# triton, transformers, tokenizers, safetensors, numpy, tqdm, httpx, prometheus-client,
# pytest), for its Python 3.12, into .whl/ (ignored by git; carried to the machine). Run here,
# where pip reaches an index; then carry .whl with benchmarks/gpu/check.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl msgspec pyzmq fastapi starlette pydantic pydantic-core \
  annotated-types typing-inspection uvicorn gguf platformdirs xxhash xgrammar==0.2.8 \
  pytest-timeout
du -sh .whl
