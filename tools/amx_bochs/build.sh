#!/bin/bash
# Builds the bare-metal harness from Banyan's working tree (banyan/kernels, read in place) into
# a disk image for Bochs, and the same harness for the host with SoftTiles only (host_ref: the
# harness's own compiler flags; host_ref_plain: plain -O2, other code generation).
#
# With a Bochs build (BOCHS_BUILD, default tools/amx_bochs/build/bochs) it also builds
# trace_tdpbf16ps against Bochs's softfloat, to follow one output of a differing block case.
#
# Usage: build.sh   (output in $AMX_BOCHS_OUT, default tools/amx_bochs/build/harness)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kernels="$here/../../banyan/kernels"
out="${AMX_BOCHS_OUT:-$here/build/harness}"
mkdir -p "$out"
cd "$here"

isa="-mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mamx-tile -mamx-bf16 -mamx-int8 -mfma"
# Freestanding: no libc, no PIC (loaded at a fixed address), no red zone (the fault handlers
# run on the same stack), nothing that needs a runtime the guest lacks (exceptions, RTTI,
# guarded statics, stack protector), and no loops turned into memcpy/memset calls inside rt.cpp.
freestanding="-ffreestanding -fno-pic -fno-pie -mno-red-zone -fno-exceptions -fno-rtti \
 -fno-threadsafe-statics -fno-asynchronous-unwind-tables -fno-stack-protector \
 -fno-tree-loop-distribute-patterns"
cxxflags="-O2 -std=gnu++17 $freestanding $isa -I$kernels -I$here"
cc() { nice -n 19 "$@"; }

cc gcc -c start.S -o "$out/start.o"
for unit in rt test_core test_kernels; do
  cc g++ $cxxflags -c $unit.cpp -o "$out/$unit.o"
done
# One identity-mapped image, code and data together: its RWX segment is meant (older ld lacks
# the option that says so, and has no warning to silence).
quiet_rwx=""
if ld --help | grep no-warn-rwx-segments > /dev/null; then quiet_rwx="--no-warn-rwx-segments"; fi
ld -nostdlib -static -z noexecstack $quiet_rwx -T link.ld \
  "$out"/{start,rt,test_core,test_kernels}.o -o "$out/harness.elf"

# Nothing may be left for a dynamic linker, and no static constructors: nothing would run them.
if nm -u "$out/harness.elf" | grep .; then echo "undefined symbols" >&2; exit 1; fi
if objdump -h "$out/harness.elf" | grep -E 'init_array|ctors'; then
  echo "static constructors present" >&2; exit 1
fi

objcopy -O binary -j .text -j .rodata -j .data "$out/harness.elf" "$out/harness.bin"
size=$(stat -c %s "$out/harness.bin")
sectors=$(( (size + 511) / 512 ))
# boot.S loads to 0x10000 in real mode; 0x9F000 is where the BIOS's data area may begin.
if [ $((0x10000 + sectors * 512)) -gt $((0x9F000)) ]; then
  echo "image too large: $size bytes" >&2; exit 1
fi
cc gcc -c -DNSECT=$sectors -x assembler-with-cpp boot.S -o "$out/boot.o"
ld -nostdlib -Ttext=0x7c00 --oformat=binary "$out/boot.o" -o "$out/boot.bin"
[ "$(stat -c %s "$out/boot.bin")" = 512 ] || { echo "boot sector is not 512 bytes" >&2; exit 1; }
truncate -s $((sectors * 512)) "$out/harness.bin"
cat "$out/boot.bin" "$out/harness.bin" > "$out/disk.img"
# bochsrc.txt's disk geometry: 20 cylinders, 16 heads, 63 sectors a track
truncate -s $((20 * 16 * 63 * 512)) "$out/disk.img"
echo "harness: $size bytes, $sectors sectors ($out/disk.img)"

host_sources="test_core.cpp test_kernels.cpp rt_host.cpp"
cc g++ $cxxflags -DRUN_AMX=0 -no-pie $host_sources -o "$out/host_ref"
cc g++ -O2 -std=gnu++17 $isa -I"$kernels" -I"$here" -DRUN_AMX=0 $host_sources \
  -o "$out/host_ref_plain"

bochs_build="${BOCHS_BUILD:-$here/build/bochs}"
softfloat="$bochs_build/cpu/softfloat3e/libsoftfloat.a"
if [ -f "$softfloat" ] && [ -d "$bochs_build/source" ]; then
  cc g++ -O2 -std=gnu++17 $isa -I"$kernels" -I"$here" -I"$bochs_build" \
    -I"$bochs_build/source" -DRUN_AMX=0 trace_tdpbf16ps.cpp rt_host.cpp "$softfloat" \
    -o "$out/trace_tdpbf16ps"
else
  echo "no Bochs build with source link in $bochs_build: trace_tdpbf16ps not built"
fi
