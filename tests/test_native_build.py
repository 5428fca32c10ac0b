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


def _compiles(march: str, source: str) -> str:
    """The compiler's errors for one source at one -march ("" when it compiles)."""
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-O3", "-shared", "-fPIC")]
    here = Path(native.__file__).parent
    done = subprocess.run([str(COMPILER), f"-march={march}", *flags, "-fsyntax-only",
                           str(here / source)], capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else done.stderr[-3000:]


@on_x86_with_compiler
def test_sources_compile_for_every_x86_family() -> None:
    known = {m for m in TARGETS if _march_known(m)}
    assert {"x86-64", "skylake-avx512"} <= known, "the compiler knows too few -march values"
    jobs = [(m, s) for m in sorted(known) for s in native.SOURCES]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        errors = dict(zip(jobs, pool.map(lambda job: _compiles(*job), jobs)))
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
