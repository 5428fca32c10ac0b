"""Native CPU kernels: C++ sources in this folder, built once per machine with the system C++
compiler and called through ctypes.

Built at first use into the user cache directory (keyed by the source, the flags and the CPU's
feature flags, since they are compiled with -march=native), by writing to a temporary file and
renaming it, so concurrent processes (server replicas, tests) never load a half-written library.
Without a compiler, or with BANYAN_NATIVE_KERNELS=0, `load()` returns None and callers keep the
PyTorch path: the kernels are an optimisation, never a requirement.

No torch headers: the sources take raw pointers, which keeps the build to about a second (an
ATen extension takes a minute). They are compiled with -fopenmp and resolve libgomp to the copy
torch has already loaded, so they share torch's OpenMP thread pool instead of adding a second
one that would spin against it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours resolves it)

logger = logging.getLogger(__name__)

_NO_RANGE = nullcontext()


def kernel_range(name: str) -> AbstractContextManager[object]:
    """A named range around a native call in torch.profiler's trace, which cannot see into
    ctypes calls (so a profile left the attention kernel's time out); only while a profiler
    records, since record_function costs a dispatcher call (~2 us) each time."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE

SOURCES = ("cpu_paged_attention.cpp", "cpu_fused_ops.cpp", "cpu_quant_linear.cpp",
           "cpu_int8g_linear.cpp", "cpu_quant_dequant.cpp", "cpu_skinny_linear.cpp",
           "cpu_layer_stack.cpp", "cpu_int8act_linear.cpp", "cpu_prefill_attention.cpp",
           "cpu_quant_gemm_bf16.cpp", "cpu_int4_bf16_linear.cpp", "cpu_kv_quant.cpp",
           "cpu_draft_pick.cpp", "cpu_argmax.cpp", "cpu_head_screen.cpp", "cpu_amx_check.cpp",
           "cpu_int8_tiles.cpp", "cpu_int8_bf16_linear.cpp", "cpu_team_check.cpp")
# -fno-trapping-math lets loops with floor() vectorise; -ffp-contract=off keeps every product
# rounded where torch rounds it (no silent fused multiply-adds).
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
ENV_SWITCH = "BANYAN_NATIVE_KERNELS"
PLAIN_BF16_KIND = 4  # banyan_quant_gemm_bf16's kind for a plain [N, K] bf16 weight (kBf16)
PAIRS_BF16_KIND = 5  # and for one stored in its pairs (kBf16Pairs: linear.pack_bf16_pairs)
# The longest step whose tokens must each come out as in a step of one (a speculative check of
# up to 15 guesses, a batch of up to 16 decodes): steps this short take the kernels a decode
# takes (quant.BF16_GEMM_MIN_TOKENS, SkinnyBf16Method.SKINNY_ROWS, the row kernel's bf16
# extends: native_plan.BF16_PAIRS_EXTEND), so speculation changes no greedy token.
EXACT_STEP_TOKENS = 16
_DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Quantized KV codes the attention kernel reads (each row with a float32 scale).
_KV_CODE_SUFFIX = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3",
                   torch.float8_e5m2: "fp8_e5m2"}


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    """Where the built libraries (and choices.py's answers) are kept."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("BANYAN_KERNEL_CACHE", user_cache_dir("banyan"))) / "kernels"


def _build(compiler: str, source_dir: Path | None = None) -> Path:  # (or an altered copy's)
    here = source_dir if source_dir is not None else Path(__file__).parent
    key = hashlib.sha256()
    for path in sorted(here.glob("*.[ch]*")):  # the sources and the headers they include
        key.update(path.read_bytes())
    key.update(" ".join((compiler, *FLAGS, cpu_flags())).encode())
    out = cache_dir() / f"banyan_cpu_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(dir=out.parent)
    try:
        # One object per source, compiled side by side (a first start waited ~30 s for one
        # serial g++ call on 2 cores), then linked.
        objects = [os.path.join(work, f"{Path(s).stem}.o") for s in SOURCES]

        def compile_one(source: str, obj: str) -> None:
            subprocess.run([compiler, *FLAGS, "-c", str(here / source), "-o", obj], check=True,
                           capture_output=True, text=True, timeout=300)

        with ThreadPoolExecutor(max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            for done in [pool.submit(compile_one, s, o) for s, o in zip(SOURCES, objects)]:
                done.result()  # (raises the first failure)
        tmp = os.path.join(work, "lib.so")
        subprocess.run([compiler, *FLAGS, *objects, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


@cache
def load() -> ctypes.CDLL | None:
    """The kernels' library, or None (disabled, not Linux x86/ARM with a C++ compiler, or the
    build failed: logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.info("no C++ compiler found: native CPU kernels off, PyTorch ops in use")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("native CPU kernels failed to build, PyTorch ops in use: %s", detail)
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.banyan_prefill_tiles.restype = lib.banyan_amx_state.restype = ctypes.c_int
    lib.banyan_amx_check_plumbing.argtypes = [ctypes.c_int]  # (tests)
    for q_sfx in _DTYPE_SUFFIX.values():
        for kv_sfx in (q_sfx, *_KV_CODE_SUFFIX.values()):
            fn = getattr(lib, f"banyan_paged_attention_{q_sfx}_{kv_sfx}")
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
            fn.argtypes += [i64, ptr, i64, i64, i64, f32, i64]
            fn.restype = None
            fn = getattr(lib, f"banyan_prefill_attention_{q_sfx}_{kv_sfx}")
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64,
                           i64, i64, f32, i64]
            fn.restype = None
            if q_sfx == "bf16" and lib.banyan_prefill_tiles():  # (cpu_prefill_tiles.h)
                tiles = getattr(lib, f"banyan_prefill_attention_tiles_{q_sfx}_{kv_sfx}")
                tiles.argtypes, tiles.restype = [*fn.argtypes, ctypes.c_int], None
    # the layer stack's (bf16 over bf16, its tile mode last), called here by tests only
    lib.banyan_prefill_attention_stack_bf16.argtypes = [
        *lib.banyan_prefill_attention_bf16_bf16.argtypes, i64]
    lib.banyan_prefill_attention_stack_bf16.restype = None
    for sfx in ("f32", "bf16"):
        signatures = {
            "banyan_add_rms_norm_": [ptr, ptr, ptr, ptr, i64, i64, f32],
            "banyan_silu_and_mul_": [ptr, ptr, i64, i64],
            "banyan_rope_qk_": [ptr, i64, ptr, ptr, ptr, ptr, f32, ptr, ptr, i64, i64, i64, i64],
        }
        for prefix, argtypes in signatures.items():
            fn = getattr(lib, prefix + sfx)
            fn.argtypes = [*argtypes, i64]
            fn.restype = None
    lib.banyan_int8_linear_f32.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64]
    lib.banyan_int8_linear_f32.restype = None
    lib.banyan_int4_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64,
                                           ptr, i64]
    lib.banyan_int4_linear_f32.restype = None
    lib.banyan_int4s_linear_f32.argtypes = lib.banyan_int4_linear_f32.argtypes
    lib.banyan_int4s_linear_f32.restype = None
    lib.banyan_int8g_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64]
    lib.banyan_int8g_linear_f32.restype = None
    lib.banyan_int4_linear_bf16_vector.argtypes = []
    lib.banyan_int4_linear_bf16_vector.restype = i64
    if lib.banyan_int4_linear_bf16_vector():  # (built with AVX512-BF16 and VBMI only)
        lib.banyan_int4_linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr,
                                                ptr, i64, ptr, i64]
        lib.banyan_int4_linear_bf16.restype = None
        lib.banyan_int8_linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64,
                                                i64]
        lib.banyan_int8_linear_bf16.restype = i64  # 0: K or the group not in fours
    # 8-bit activations (cpu_int8act_linear.cpp, layers/int8_activations.py)
    lib.banyan_q8_int4_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64,
                                              i64]
    lib.banyan_q8_int4s_linear_f32.argtypes = lib.banyan_q8_int4_linear_f32.argtypes
    lib.banyan_q8_int8_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64]
    lib.banyan_q8_int5_linear_f32.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64]
    lib.banyan_q8_quantize_f32.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.banyan_q8_linear_bf16.argtypes = [i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr,
                                           i64, i64]
    lib.banyan_q8_linear_bf16.restype = None
    for name in ("int4", "int4s", "int8", "int5"):
        getattr(lib, f"banyan_q8_{name}_linear_f32").restype = None
    lib.banyan_q8_quantize_f32.restype = None
    # --activation-quant int8_tiles (cpu_int8_tiles.cpp, layers/int8_tiles.py)
    lib.banyan_int8_tiles_here.argtypes, lib.banyan_int8_tiles_here.restype = [], i64
    if lib.banyan_int8_tiles_here():
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"banyan_int8_tiles_linear_{suffix}")
            fn.argtypes, fn.restype = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64], None
        lib.banyan_int8_tiles_quantize_f32.argtypes = [ptr, i64, i64, ptr, ptr]
        lib.banyan_int8_tiles_quantize_f32.restype = None
    lib.banyan_quant_gemm_bf16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr,
                                           i64, i64]
    lib.banyan_quant_gemm_bf16.restype = None
    lib.banyan_quant_gemm_bf16_vector.argtypes = []
    lib.banyan_quant_gemm_bf16_vector.restype = ctypes.c_int
    if lib.banyan_quant_gemm_bf16_vector():  # (built with AVX512-BF16 only)
        lib.banyan_quant_dequant_bf16.argtypes = [i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64]
        lib.banyan_quant_dequant_bf16.restype = None
    lib.banyan_int8_dequant_f32.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64]
    lib.banyan_int8g_dequant_f32.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i64]
    lib.banyan_int4_dequant_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64]
    lib.banyan_int4s_dequant_f32.argtypes = lib.banyan_int4_dequant_f32.argtypes
    for name in ("int8", "int8g", "int4", "int4s"):
        getattr(lib, f"banyan_{name}_dequant_f32").restype = None
    lib.banyan_draft_pick.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, f32, ptr, ptr]
    lib.banyan_draft_pick.restype = None  # (spec/draft_head.py)
    for suffix in _DTYPE_SUFFIX.values():
        skinny = getattr(lib, f"banyan_skinny_linear_{suffix}")
        skinny.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64]
        skinny.restype = None
        stack = getattr(lib, f"banyan_layer_stack_{suffix}")  # models/native_stack.py
        stack.argtypes = [ptr, ptr]
        stack.restype = i64
    lib.banyan_vector_bits.argtypes = []
    lib.banyan_vector_bits.restype = i64
    lib.banyan_prefill_pairs.argtypes = []
    lib.banyan_prefill_pairs.restype = ctypes.c_int
    lib.banyan_set_decode_tiles.argtypes, lib.banyan_set_decode_tiles.restype = [i64], i64
    lib.banyan_set_gemm_tiles.argtypes, lib.banyan_set_gemm_tiles.restype = [i64, i64, i64], i64
    return lib


@cache
def vector_bits() -> int:
    """512 when the kernels were built with their AVX-512 paths, 256 with the AVX2 ones, 0 for
    the portable loops alone (or no kernels)."""
    lib = load()
    return 0 if lib is None else int(lib.banyan_vector_bits())


@cache
def prefill_tiles() -> int:
    """2 where the prefill kernel can run its products on AMX tiles (cpu_prefill_tiles.h; Linux
    granted the tile state), 1 where only emulated in memory (tests), 0 no tile path."""
    lib = load()
    return 0 if lib is None else int(lib.banyan_prefill_tiles())


def set_decode_tiles(mode: int) -> int:
    """The row kernel's products for bf16 queries over a bf16 pool, for the whole process from
    now on (cpu_attend_tiles.h): 0 its vector loops, 1 tiles emulated in memory (tests), 2 AMX
    tiles (only where prefill_tiles() is 2); any other value only asks. Returns the mode in
    effect."""
    lib = load()
    return 0 if lib is None else int(lib.banyan_set_decode_tiles(mode))


@cache
def prefill_pairs_here() -> bool:
    """Whether the prefill kernel runs bf16 queries (over a bf16, int8 or fp8 pool) as
    vdpbf16ps over bf16 pairs (cpu_prefill_pairs.h: AVX512-BF16 CPUs)."""
    lib = load()
    return lib is not None and bool(lib.banyan_prefill_pairs())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias), all float32 or all bfloat16 on CPU, contiguous: every
    weight row read once per 8 tokens (cpu_skinny_linear.cpp). For small T, where GEMM
    libraries are slow."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    kernel = (lib.banyan_skinny_linear_bf16 if x.dtype == torch.bfloat16
              else lib.banyan_skinny_linear_f32)
    out = x.new_empty((x.shape[0], weight.shape[0]))
    with kernel_range("banyan::skinny_linear"):
        kernel(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
               None if bias is None else bias.data_ptr(), out.data_ptr(), weight.shape[0],
               torch.get_num_threads())
    return out


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T, both bf16, contiguous, K even: the bf16 GEMM kernel on a
    plain weight (float32 sums, one rounding per output)."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    out = x.new_empty((x.shape[0], weight.shape[0]))
    with kernel_range("banyan::bf16_gemm"):
        lib.banyan_quant_gemm_bf16(x.data_ptr(), x.shape[0], x.shape[1], PLAIN_BF16_KIND,
                                   weight.data_ptr(), None, None, 0, None, out.data_ptr(),
                                   weight.shape[0], torch.get_num_threads())
    return out


def data_ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a kernel's pointer argument; None (a null pointer) for None."""
    return None if t is None else t.data_ptr()


def bf16_pairs_gemm(x: torch.Tensor, pairs: torch.Tensor, rows: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] bf16 @ W^T (+ bias, float32 [rows]) for W [rows, K] stored by
    layers.linear.pack_bf16_pairs: float32 sums, the bias added, one rounding per output (the
    same bits as bf16_gemm on the plain weight, and as the skinny bf16 kernel's definition)."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    out = x.new_empty((x.shape[0], rows))
    with kernel_range("banyan::bf16_gemm"):
        lib.banyan_quant_gemm_bf16(x.data_ptr(), x.shape[0], x.shape[1], PAIRS_BF16_KIND,
                                   pairs.data_ptr(), None, None, 0,
                                   data_ptr(bias), out.data_ptr(),
                                   rows, torch.get_num_threads())
    return out


@cache
def bf16_gemm_here() -> bool:
    """Whether the bf16 GEMM kernel (cpu_quant_gemm_bf16.cpp) runs on vdpbf16ps here (its
    scalar twin is for tests)."""
    lib = load()
    return lib is not None and bool(lib.banyan_quant_gemm_bf16_vector())


@cache
def codes_bf16_here() -> bool:
    """Whether int4 codes (and int8 ones with a scale per row) times bf16 activations run
    natively here (cpu_int4_bf16_linear.cpp, cpu_int8_bf16_linear.cpp; elsewhere a bf16 step's
    quantized layers widen x to float32)."""
    lib = load()
    return lib is not None and bool(lib.banyan_int4_linear_bf16_vector())


@cache
def amx_here() -> bool:
    """Whether this CPU has AMX tiles for bf16 (which oneDNN's GEMMs use)."""
    return "amx_bf16" in cpu_flags().split()


def bf16_gemm_applies(in_features: int) -> bool:
    """Whether a layer's long bf16 steps may run the bf16 GEMM kernel: the one rule for the
    quantized methods' and the dense bf16 method's `apply` and the native layer stack. (It
    reads inputs in pairs: an odd width keeps the other kernels.)"""
    return in_features % 2 == 0 and bf16_gemm_here()


def supports(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
             ) -> bool:
    """Whether the kernel can serve a pool on this device with this compute dtype and these
    K/V codes (None: the compute dtype itself)."""
    return (device.type == "cpu" and dtype in _DTYPE_SUFFIX and
            (kv_dtype is None or kv_dtype == dtype or kv_dtype in _KV_CODE_SUFFIX) and
            load() is not None)
