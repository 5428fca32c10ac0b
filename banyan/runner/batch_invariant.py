"""--enable-deterministic-inference: a request's tokens (and logprobs) do not depend on what
else the engine runs, how its prompt is chunked, whether its prefix was cached, whether it was
retracted and recomputed, or whether speculation checked its tokens.

Why they do by default: the kernels pick their arithmetic by the step's size. A decode or a
short extend (up to native.EXACT_STEP_TOKENS) takes the row attention kernel and the short
linear kernels, whose bits for a token are those it gets alone; a longer prompt chunk takes the
blocked prefill attention kernel and GEMMs (oneDNN past 256 tokens, a quantized layer's weights
rounded to bf16 from 17), which sum in other orders. In bf16 a last-bit difference moves a
near-tie within a few dozen tokens: twelve prompts on SmolLM2 (bf16, Zen 4) decoded alone
with a 24 MiB pool (admission and chunking change, three retractions) or 64-token chunks
parted from the plain run in 1-3 of 12 texts, as did ngram speculation with the small pool.

Here every step size runs the short kernels: every extend goes to the row kernel
(CpuNativeBackend.take_every_extend), and every linear method keeps its step-size-invariant
kernel (LinearMethod.batch_invariant: the bf16 pairs GEMM or skinny kernel, the skinny float32
kernel, the quantized methods' short kernels), on the vector loops where AMX's tiles would take
long steps of the GEMM. The rest of a step is per token already (norms,
RoPE, SiLU, the sampler's per-row arithmetic; seeded sampling hashes seed and position). The
price is in long prompt chunks (docs/performance.md): decodes run the same kernels as before.
SGLang's `--enable-deterministic-inference` and vLLM's VLLM_BATCH_INVARIANT do this on GPUs only.
"""

from __future__ import annotations

from torch import nn

from banyan.attention.base import AttentionBackend
from banyan.attention.cpu_native import CpuNativeBackend
from banyan.layers.gemm_tiles import set_gemm_tiles
from banyan.layers.linear import Linear

FLAG = "enable_deterministic_inference"


def make_batch_invariant(model: nn.Module, backend: AttentionBackend) -> None:
    """Switch the model's linears and the attention backend to their step-size-invariant
    kernels; ValueError naming what cannot (a library GEMM, a non-native attention backend)."""
    if not isinstance(backend, CpuNativeBackend):
        raise ValueError(f"{FLAG} needs the cpu-native attention backend (a CPU with the native "
                         f"kernels built); this engine runs {backend.name!r}")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    refused = sorted({type(m.method).__name__ for m in linears
                      if not m.method.can_be_batch_invariant})
    if refused:
        raise ValueError(f"{FLAG}: linear layers computed by {', '.join(refused)} (a library "
                         "GEMM, whose sums depend on the step's size) have no batch-invariant "
                         "kernel; it needs the native kernels (float32 or bf16 on CPU)")
    for layer in linears:  # (before the layer stack is built: it reads them once)
        layer.method.make_batch_invariant(layer)
    # The bf16 GEMM's AMX tiles take long steps only (layers/gemm_tiles.py), with other bits
    # than a token gets alone: the vector loop at every size, for the whole process (one mode
    # a process; a quantized model's route may have set the tiles)
    set_gemm_tiles(0)
    backend.take_every_extend()
