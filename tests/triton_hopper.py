"""Compiles the Triton attention and quantized-linear kernels for a Hopper GPU (sm_90) on this
host and prints one JSON line per kernel variant: {"case", "shared", "mma"}. Run as a process
of its own by tests/test_triton_compile.py: under TRITON_INTERPRET=1 (which the interpreter
tests set in the test process) `triton.jit` makes interpreted functions, which cannot be
compiled."""

from __future__ import annotations

import json
import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from banyan.kernels import triton_attention as ta
from banyan.kernels import triton_fused as tf
from banyan.kernels import triton_quant_linear as tq

HOPPER = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
SHAPES = [(3, 64), (4, 128)]  # (GQA group, head_dim): SmolLM2's and Llama 3 8B's
SPLITS = [1, 16]
WIDTHS = [576, 2048]  # hidden sizes of the fused norm: SmolLM2's, Llama 3.2 1B's
# a quantized pool's codes (bf16 queries)
QUANTIZED = {torch.int8: "int8", torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}


def compile_for_hopper(fn: triton.JITFunction, pointers: dict[str, str],
                       constexprs: dict[str, object], **options: int | bool) -> object:
    """Arguments not named: int32 scalars (strides, counts) or float32 (the scale)."""
    signature = {name: ("constexpr" if name in constexprs else
                        pointers.get(name, "fp32" if name == "scale_log2" else "i32"))
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=HOPPER, options=options)


def kernels(dtype: torch.dtype, group: int, head_dim: int,
            codes: torch.dtype | None = None) -> dict[str, object]:
    """The decode and extend kernels with the tile parameters their launchers use, over a pool
    of `dtype` or (codes) of one-byte codes with float32 row scales, queries in `dtype`."""
    q = "*" + TYPES[dtype]
    quant = ta.QUANT_OF[codes] if codes is not None else ta.PLAIN.value
    pool = q if codes is None else "*i8" if codes == torch.int8 else "*u8"
    upcast, precision = ta.dot_flags(dtype, interpreted=False)  # as on a GPU
    consts = dict(UPCAST=upcast, PRECISION=precision, QUANT=quant)
    kv = {"K": pool, "V": pool, "KS": "*fp32", "VS": "*fp32"}
    block_d = ta.head_block(head_dim)
    block_h, head_blocks = ta.decode_tile(group)
    ints = dict.fromkeys(("Table", "Rows", "SeqLens", "Tokens"), "*i32")
    decode = compile_for_hopper(
        ta._decode_split_kernel, {"Q": q, **kv, **ints, "MidO": "*fp32", "MidLse": "*fp32"},
        dict(GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_H=block_h,
             BLOCK_N=ta.DECODE_BLOCK_N, BLOCK_D=block_d, **consts),
        num_warps=4, num_stages=2)
    block_m, block_n = ta.extend_blocks(head_dim)
    ints = dict.fromkeys(("Table", "BlockReq", "BlockStart", "ReqRow", "ReqPrefix", "ReqLen",
                          "ReqToken"), "*i32")
    extend = compile_for_hopper(
        ta._extend_kernel, {"Q": q, **kv, "Out": q, **ints},
        dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
             **consts),
        num_warps=4, num_stages=2)
    return {"decode": decode, "extend": extend}


def quant_linear_kernels() -> dict[str, object]:
    """The weight-only int8 / int4 linear (kernels/triton_quant_linear.py) for a decode-sized
    and a prefill-sized block of rows, bf16 and float32 activations."""
    out = {}
    for dtype, name in TYPES.items():
        upcast, precision = ta.dot_flags(dtype, interpreted=False)
        x = "*" + TYPES[dtype]
        for int4 in (False, True):
            for rows in (1, 512):
                bm = tq.block_m(rows)
                out[f"quant-linear-{'int4' if int4 else 'int8'}-{name}-m{bm}"] = compile_for_hopper(
                    tq._quant_linear_kernel,
                    {"X": x, "W": "*u8" if int4 else "*i8", "Scale": "*fp16" if int4 else "*fp32",
                     "Mins": "*fp16" if int4 else "*fp32", "Bias": "*fp32", "Out": x},
                    dict(INT4=int4, GROUP=32, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=tq.BLOCK_N,
                         BLOCK_K=tq.BLOCK_K, UPCAST=upcast, PRECISION=precision),
                    num_warps=4, num_stages=2)
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile with the interpreter off"
    for dtype, name in TYPES.items():
        for group, head_dim in SHAPES:
            for kind, k in kernels(dtype, group, head_dim).items():
                print(json.dumps({"case": f"{kind}-{name}-g{group}-d{head_dim}",
                                  "shared": k.metadata.shared, "mma": "mma" in k.asm["ptx"]}))
    for codes, name in QUANTIZED.items():  # bf16 queries over a quantized pool, SmolLM2's shape
        for kind, k in kernels(torch.bfloat16, 3, 64, codes).items():
            print(json.dumps({"case": f"{kind}-{name}-g3-d64", "shared": k.metadata.shared,
                              "mma": "mma" in k.asm["ptx"]}))
    for case, k in quant_linear_kernels().items():
        print(json.dumps({"case": case, "shared": k.metadata.shared,
                          "mma": "mma" in k.asm["ptx"]}))
    for splits in SPLITS:
        k = compile_for_hopper(
            ta._decode_merge_kernel,
            {"MidO": "*fp32", "MidLse": "*fp32", "Tokens": "*i32", "Out": "*bf16"},
            dict(HEAD_DIM=64, BLOCK_S=ta._pow2(splits), BLOCK_D=64), num_warps=4)
        print(json.dumps({"case": f"merge-s{splits}", "shared": k.metadata.shared,
                          "mma": False}))
    for dtype, name in TYPES.items():
        for case, k in fused_kernels(dtype).items():
            print(json.dumps({"case": f"{case}-{name}", "shared": k.metadata.shared,
                              "mma": False}))


def fused_kernels(dtype: torch.dtype) -> dict[str, object]:
    """The element-wise kernels, with the block sizes and options their launchers use."""
    p = "*" + TYPES[dtype]
    out = {}
    for n in WIDTHS:
        block = triton.next_power_of_2(n)
        out[f"rmsnorm-{n}"] = compile_for_hopper(
            tf._add_rms_norm_kernel, {"X": p, "R": p, "W": p, "Out": p, "eps": "fp32"},
            dict(HAS_RESIDUAL=True, BLOCK=block), num_warps=tf._warps(block),
            enable_fp_fusion=False)
    out["silu"] = compile_for_hopper(tf._silu_and_mul_kernel, {"GateUp": p, "Out": p},
                                     dict(BLOCK=1024), num_warps=tf._warps(1024),
                                     enable_fp_fusion=False)
    for norms in (False, True):  # Qwen3's q/k head norms
        out[f"rope{'-norms' if norms else ''}"] = compile_for_hopper(
            tf._rope_qk_kernel, {"QKV": p, "Cos": p, "Sin": p, "QNorm": p, "KNorm": p, "Q": p,
                                 "K": p, "eps": "fp32"},
            dict(HALF=32, BLOCK=32, HEAD_NORMS=norms), num_warps=1, enable_fp_fusion=False)
    return out


if __name__ == "__main__":
    main()
