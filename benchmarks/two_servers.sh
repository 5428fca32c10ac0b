#!/bin/bash
# Two `banyan serve` of the default model on one machine, each streaming batch-1 completions
# (6 x 128/128, one at a time) at the same moment: the shared-CPU case of issue 13, for each
# thread setting in CFGS (default: the governed default, then --num-threads 2 = the previous
# default). Writes benchmarks/results/two-servers-$TAG.json.
#   TAG=zen3 benchmarks/two_servers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${TAG:-local}
OUT=$(mktemp -d)
TOK=$(python -c "from banyan.model_files import resolve_model_dir; print(resolve_model_dir(None))")
for cfg in ${CFGS:-default fixed2 one}; do
  extra=""
  [ "$cfg" = fixed2 ] && extra="--num-threads 2"
  [ "$cfg" = one ] && extra="--num-threads 1"
  for p in 46021 46022; do banyan serve --port $p $extra > "$OUT/$cfg-$p.log" 2>&1 & done
  for p in 46021 46022; do
    for _ in $(seq 120); do curl -sf localhost:$p/health >/dev/null && break; sleep 0.5; done
  done
  pids=()
  for p in 46021 46022; do
    banyan bench serve --base-url http://127.0.0.1:$p --tokenizer "$TOK" --workload random \
      --num-requests 6 --concurrency 1 --input-len 128 --output-len 128 --disable-tqdm \
      --out "$OUT/$cfg-$p.json" > /dev/null 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  pkill -f "banyan serve --port 4602[12]" || true
  sleep 3
done
python - "$OUT" "$TAG" "$*" <<'PY'
import json, sys
from pathlib import Path
from banyan.bench.offline import machine_info
out, tag = Path(sys.argv[1]), sys.argv[2]
result = {"command": f"TAG={tag} benchmarks/two_servers.sh", "machine": machine_info(),
          "workload": "two servers, each 6 x 128/128 batch-1 at the same time", "configs": {}}
for f in sorted(out.glob("*.json")):
    cfg, port = f.stem.rsplit("-", 1)
    s = json.loads(f.read_text())["summary"]
    switches = (out / f"{cfg}-{port}.log").read_text().count("steps now run on")
    result["configs"].setdefault(cfg, {})[port] = {
        "output_tok_s": s["output_tok_s"], "tpot_p50_ms": s["tpot_ms"]["p50"],
        "thread_switches": switches}
    print(f"{cfg:8s} {port}  {s['output_tok_s']:6.1f} output tok/s  TPOT p50 "
          f"{s['tpot_ms']['p50']:6.1f} ms  switches {switches}")
Path("benchmarks/results").joinpath(f"two-servers-{tag}.json").write_text(
    json.dumps(result, indent=2))
PY
