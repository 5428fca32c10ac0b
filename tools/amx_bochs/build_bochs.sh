#!/bin/bash
# Builds the Bochs the AMX check runs on: applies the four fixes (bochs_fixes.py, README.md) to
# a Bochs source checkout, in place, then configures and builds it out of tree.
#
# Usage: build_bochs.sh BOCHS_CHECKOUT [BUILD_DIR]
#   BOCHS_CHECKOUT  a clone of github:bochs-emu/Bochs (its top folder or its bochs/ folder)
#   BUILD_DIR       default $BOCHS_BUILD, else tools/amx_bochs/build/bochs (git-ignored)
#   JOBS            make's -j (default 2)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tested_commit=783b58fd6

[ $# -ge 1 ] || { sed -n '2,8p' "$0"; exit 2; }
checkout="$(cd "$1" && pwd)"
if [ -f "$checkout/bochs/configure" ]; then src="$checkout/bochs"
elif [ -f "$checkout/configure" ] && [ -d "$checkout/cpu" ]; then src="$checkout"
else echo "no Bochs configure script in $checkout or $checkout/bochs" >&2; exit 1
fi
build="${2:-${BOCHS_BUILD:-$here/build/bochs}}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"

# Another commit may build and pass, but the fixes' patterns were written against this one.
head="$(git -C "$src" rev-parse --short=9 HEAD 2>/dev/null || echo unknown)"
if [ "$head" != "$tested_commit" ]; then
  echo "note: Bochs checkout at $head; the fixes were tested at $tested_commit" >&2
fi

python3 "$here/bochs_fixes.py" "$src"

# The CPU features the harness needs (x86-64, AVX-512 with BF16, AMX); no GUI, debugger or
# devices it does not use, so that the build is shorter.
cd "$build"
if [ ! -f Makefile ]; then
  echo "configuring in $build (configure.log)"
  nice -n 19 "$src/configure" --enable-x86-64 --enable-avx --enable-evex --enable-amx \
    --with-nogui --disable-debugger --enable-all-optimizations --disable-cdrom \
    --disable-sb16 --disable-usb --enable-a20-pin > configure.log 2>&1 \
    || { tail -20 configure.log; exit 1; }
fi
echo "building in $build (make.log; minutes)"
nice -n 19 make -j"${JOBS:-2}" > make.log 2>&1 || { tail -30 make.log; exit 1; }

# run.sh points Bochs's $BXSHARE here: the BIOS images, so that the build folder alone is
# enough to run the check.
mkdir -p share
cp "$src/bios/BIOS-bochs-latest" "$src/bios/VGABIOS-lgpl/VGABIOS-lgpl-latest.bin" share/
# build.sh's trace_tdpbf16ps compiles against this source's softfloat headers.
ln -sfn "$src" source
echo "Bochs built: $build/bochs"
