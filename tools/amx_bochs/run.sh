#!/bin/bash
# Runs the harness (build.sh) in Bochs (build_bochs.sh), then the host builds, and compares:
# AMX against SoftTiles inside Bochs, and Bochs's SoftTiles results against the host's.
# Exit status 0 when compare.py finds nothing wrong (README.md, "Reading the output").
#
# Usage: run.sh   (BOCHS_BUILD: Bochs's build folder, default tools/amx_bochs/build/bochs;
#                  AMX_BOCHS_OUT: build.sh's output; TIMEOUT: seconds for Bochs, default 1800)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bochs_build="${BOCHS_BUILD:-$here/build/bochs}"
export AMX_BOCHS_OUT="${AMX_BOCHS_OUT:-$here/build/harness}"
export BXSHARE="$bochs_build/share"  # bochsrc.txt's BIOS images
out="$AMX_BOCHS_OUT"

[ -x "$bochs_build/bochs" ] && [ -d "$BXSHARE" ] || {
  echo "no Bochs in $bochs_build: run build_bochs.sh BOCHS_CHECKOUT first" >&2; exit 2; }
[ -f "$out/disk.img" ] || { echo "no harness in $out: run build.sh first" >&2; exit 2; }

start=$(date +%s)
timeout "${TIMEOUT:-1800}" nice -n 19 "$bochs_build/bochs" -q -f "$here/bochsrc.txt" \
  > "$out/bochs_e9.txt" 2> "$out/bochs_stderr.txt"
status=$?
# Bochs leaves with status 1 after the harness's power-off; compare.py judges the output.
how="exit status $status"
if grep -q "shutdown requested" "$out/bochs_stderr.txt"; then how="powered off by the harness"; fi
echo "bochs: $how, $(( $(date +%s) - start )) s, output in $out/bochs_e9.txt"

# The host builds execute AVX-512 BF16 natively (the kernels' conversions); without it there
# is no host side to compare with, and compare.py says so.
host_outputs=()
if grep -q avx512_bf16 /proc/cpuinfo; then
  "$out/host_ref" > "$out/host_ref.txt"
  "$out/host_ref_plain" > "$out/host_ref_plain.txt"
  host_outputs=("$out/host_ref.txt" "$out/host_ref_plain.txt")
fi
python3 "$here/compare.py" "$out/bochs_e9.txt" "${host_outputs[@]}"
