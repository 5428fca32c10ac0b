"""The native CPU kernels build on every x86 family Banyan runs on, not only on this machine's.

They compile with -march=native, so a developer's machine only ever checks its own ISA branch:
an AVX2-only machine once passed the suite while every AVX-512 machine lost all kernels (a helper
defined only in the AVX2 branch), 300 tests skipped and the quantized formats refused to start.
Here every source is compiled (syntax and template instantiation, no code generation) for one
-march per family, and the library must load on this machine whenever a compiler is present.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from banyan.kernels import native

COMPILER = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
# -march per family: the portable loops, AVX2 (Zen 3), AVX-VNNI without AVX-512 (Alder Lake),
# AVX-512 without BF16/VNNI (Skylake-SP), AVX-512 BF16 + VNNI without FP16/AMX (Zen 4's ISA:
# GCC 12 has no znver4), AVX-512 FP16 + AMX (Sapphire Rapids).
TARGETS = ("x86-64", "znver3", "alderlake", "skylake-avx512", "cooperlake", "sapphirerapids")
on_x86_with_compiler = pytest.mark.skipif(
    COMPILER is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs an x86-64 machine with a C++ compiler")


def _check_flags(march: str) -> list[str]:
    return [f"-march={march}", *(f for f in native.FLAGS
                                 if f not in ("-march=native", "-O3", "-shared", "-fPIC"))]


def _precompiled_headers(march: str, work: Path) -> list[str]:
    """-include flags for one precompiled header of every system header the kernels include,
    built for this -march (a precompiled header serves only the flags it was built with):
    parsing them took ~1.1 s of each source's 1.2 s check on a Zen 1. Where it cannot be built
    the sources parse the headers themselves (an unusable one GCC ignores likewise)."""
    here = Path(native.__file__).parent
    names = sorted({line.strip() for path in here.glob("*.[ch]*")
                    for line in path.read_text().splitlines()
                    if line.startswith("#include <")})
    header = work / march / "system.h"
    header.parent.mkdir(parents=True)
    header.write_text("\n".join(names) + "\n")
    done = subprocess.run([str(COMPILER), *_check_flags(march), "-x", "c++-header", str(header),
                           "-o", f"{header}.gch"], capture_output=True, text=True, timeout=300)
    return ["-include", str(header)] if done.returncode == 0 else []


def _compiles(march: str, source: str, prefix: list[str]) -> str:
    """The compiler's errors for one source at one -march ("" when it compiles)."""
    here = Path(native.__file__).parent
    done = subprocess.run([str(COMPILER), *_check_flags(march), *prefix, "-fsyntax-only",
                           str(here / source)], capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else done.stderr[-3000:]


@on_x86_with_compiler
def test_sources_compile_for_every_x86_family(tmp_path: Path) -> None:
    known = sorted(m for m in TARGETS if _march_known(m))
    assert {"x86-64", "skylake-avx512"} <= set(known), "the compiler knows too few -march values"
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        prefixes = dict(zip(known, pool.map(lambda m: _precompiled_headers(m, tmp_path), known)))
        jobs = [(m, s) for m in known for s in native.SOURCES]
        errors = dict(zip(jobs, pool.map(lambda job: _compiles(*job, prefixes[job[0]]), jobs)))
    failed = {f"{m}: {s}": e for (m, s), e in errors.items() if e}
    assert not failed, "\n".join(f"{k}\n{v}" for k, v in failed.items())


def _march_known(march: str) -> bool:
    done = subprocess.run([str(COMPILER), f"-march={march}", "-x", "c++", "-fsyntax-only", "-"],
                          input="", capture_output=True, text=True, timeout=60)
    return done.returncode == 0


@on_x86_with_compiler
def test_kernels_load_on_this_machine() -> None:
    if os.environ.get(native.ENV_SWITCH, "1") == "0":
        pytest.skip(f"{native.ENV_SWITCH}=0 turns the kernels off")
    assert native.load() is not None, "the native kernels did not build here (see the log)"
    assert native.vector_bits() in (256, 512) or "avx2" not in native.cpu_flags()


# Helpers called per lane inside `omp simd` loops: an out-of-line copy means those loops make a
# scalar call per element (exp_nonpos_fma fell out of line in attend_pairs once, and a decode
# group's shared prefix ran 2-3x slower with every output still right).
PER_LANE_HELPERS = ("exp_nonpos_fma", "fmadd(")


@on_x86_with_compiler
def test_per_lane_helpers_are_inlined() -> None:
    nm = shutil.which("nm")
    lib = native.load()
    if nm is None or lib is None:
        pytest.skip("needs nm and the built kernels")
    symbols = subprocess.run([nm, "-C", lib._name], capture_output=True, text=True,
                             timeout=60).stdout
    left = [line for line in symbols.splitlines() if any(h in line for h in PER_LANE_HELPERS)]
    assert not left, "\n".join(left)
