"""What `--dtype auto` computes in on a CPU.

A bfloat16 (or float16) checkpoint on a CPU without arithmetic in that type (AVX512_BF16 / AMX
for bfloat16, AVX512_FP16 / AMX-FP16 for float16: AMD Zen 2/3, Intel before Cooper Lake) has
every matmul emulated: oneDNN widens each operand block to float32 and rounds the results back,
so the half type saves memory and costs time. On Zen 3 a SmolLM2-shaped bfloat16 model decoded
4-5x slower than the same weights in float32 (docs/performance.md). There `auto` computes in
float32 (every bfloat16/float16 value is exact in float32, so outputs get closer to the
float32 reference, not further), as long as the widened weights fit in half of the free memory;
an explicit `--dtype bfloat16` keeps bfloat16.

The other way round, a model whose linears are quantized (int8 / int4 / a GGUF file's blocks)
computes in bfloat16 under `auto` where the CPU has bf16 units and the bf16 GEMM over quantized
weights runs on them (kernels/cpu_quant_gemm_bf16.cpp): the weights lost far more to 4 or 8
bits than activations lose to bf16 (perplexity within 0.5% of float32 activations), and on Zen 5
a random 64 x 128/128 run of the default Q4_1 model went 236 -> 834 tok/s, batch-1 decode the
same, the first token of a 128-token prompt 0.11 -> 0.06 s, and the KV cache holds twice the
tokens. `--dtype float32` keeps float32, the dtype whose greedy output equals the reference's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from banyan.kernels.native import bf16_gemm_here, cpu_flags
from banyan.models.config import resolve_dtype
from banyan.runner.device import available_memory

logger = logging.getLogger(__name__)

# The /proc/cpuinfo flags of units that compute in each half type.
HALF_UNITS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


def cpu_computes(dtype: torch.dtype, flags: str | None = None) -> bool | None:
    """Whether this CPU has arithmetic units for `dtype` (None: its flags are unknown)."""
    flags = cpu_flags() if flags is None else flags
    if dtype not in HALF_UNITS:
        return True
    if not flags:
        return None
    present = set(flags.split())
    return any(unit in present for unit in HALF_UNITS[dtype])


def auto_cpu_dtype(checkpoint: torch.dtype, checkpoint_bytes: int, available_bytes: int,
                   flags: str | None = None) -> tuple[torch.dtype, str | None]:
    """(dtype `auto` computes in on this CPU, why it differs from the checkpoint's or None)."""
    if cpu_computes(checkpoint, flags) is not False:
        return checkpoint, None
    widened = checkpoint_bytes * 4 // checkpoint.itemsize
    if widened > available_bytes // 2:
        return checkpoint, None  # float32 weights would crowd out the KV cache (or not fit)
    units = " / ".join(u.upper() for u in HALF_UNITS[checkpoint])
    why = (f"the checkpoint is {str(checkpoint).removeprefix('torch.')} but this CPU has no "
           f"{units}: computing in float32 ({widened / 2**30:.2f} GiB of weights), which is "
           f"exact and faster here; --dtype {str(checkpoint).removeprefix('torch.')} keeps the "
           "checkpoint's type")
    return torch.float32, why


def compute_dtype(requested: str | torch.dtype | None, checkpoint: torch.dtype,
                  device: torch.device, model_path: str | Path,
                  quantized: bool = False) -> torch.dtype:
    """The dtype a model computes in: the requested one, or for `auto` the checkpoint's, except
    on a CPU without units for it (auto_cpu_dtype), and bfloat16 for quantized linears on a
    CPU that computes it (see the module; both logged)."""
    dtype = resolve_dtype(requested, checkpoint)
    if requested not in (None, "auto") or device.type != "cpu":
        return dtype
    if quantized and dtype == torch.float32 and bf16_gemm_here():
        logger.info("--dtype auto: the linears are quantized and this CPU computes in "
                    "bfloat16 (AVX512-BF16): activations in bfloat16; --dtype float32 keeps "
                    "float32")
        return torch.bfloat16
    files = sorted(Path(model_path).glob("*.safetensors"))
    dtype, why = auto_cpu_dtype(dtype, sum(f.stat().st_size for f in files),
                                available_memory(device))
    if why:
        logger.warning("--dtype auto: %s", why)
    return dtype
