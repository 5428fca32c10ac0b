"""The Triton attention kernels compiled for a Hopper GPU (sm_90) here, without one: Triton's
compiler and ptxas run on the host, so what the interpreter never sees (tl.dot's shape and dtype
rules, shared memory, register allocation) is checked by every developer and CI. The tile
parameters are the ones the launchers use (decode_tile, extend_blocks, head_block).

Shapes: head_dim 64 (SmolLM2) and 128 (Llama 3 8B), GQA groups 3 and 4, bf16 and float32 pools
(float32 with IEEE products), one and 16 decode splits in the merge."""

from __future__ import annotations

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from banyan.kernels import triton_attention as ta

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY = 227 * 1024  # an H100/H200 block's opt-in shared memory
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_for_hopper(fn: triton.JITFunction, pointers: dict[str, str],
                       constexprs: dict[str, object], **options: int) -> object:
    """Arguments not named: int32 scalars (strides, counts) or float32 (the scale)."""
    signature = {name: ("constexpr" if name in constexprs else
                        pointers.get(name, "fp32" if name == "scale_log2" else "i32"))
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=HOPPER, options=options)


def pool_pointers(dtype: torch.dtype, *names: str) -> dict[str, str]:
    return {name: "*" + TYPES[dtype] for name in names}


@pytest.mark.parametrize("dtype", list(TYPES), ids=list(TYPES.values()))
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128)])
def test_decode_and_extend_compile_for_hopper(dtype: torch.dtype, group: int,
                                              head_dim: int) -> None:
    upcast, precision = ta._dot_flags(dtype)
    assert not upcast  # not interpreted: the compiled kernels keep bf16 products
    block_d = ta.head_block(head_dim)
    block_h, head_blocks = ta.decode_tile(group)
    ints = dict.fromkeys(("Table", "Rows", "SeqLens", "Tokens"), "*i32")
    decode = compile_for_hopper(
        ta._decode_split_kernel,
        {**pool_pointers(dtype, "Q", "K", "V"), **ints, "MidO": "*fp32", "MidLse": "*fp32"},
        dict(GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_H=block_h,
             BLOCK_N=ta.DECODE_BLOCK_N, BLOCK_D=block_d, UPCAST=upcast, PRECISION=precision),
        num_warps=4, num_stages=2)
    block_m, block_n = ta.extend_blocks(head_dim)
    ints = dict.fromkeys(("Table", "BlockReq", "BlockStart", "ReqRow", "ReqPrefix", "ReqLen",
                          "ReqToken"), "*i32")
    extend = compile_for_hopper(
        ta._extend_kernel, {**pool_pointers(dtype, "Q", "K", "V", "Out"), **ints},
        dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
             UPCAST=upcast, PRECISION=precision),
        num_warps=4, num_stages=2)
    for kernel in (decode, extend):
        assert 0 < kernel.metadata.shared <= SHARED_MEMORY
    if dtype == torch.bfloat16:  # the products run on tensor cores: Hopper's wgmma or mma
        assert "mma" in extend.asm["ptx"]


@pytest.mark.parametrize("splits", [1, 16])
def test_merge_compiles_for_hopper(splits: int) -> None:
    compile_for_hopper(
        ta._decode_merge_kernel, {"MidO": "*fp32", "MidLse": "*fp32", "Tokens": "*i32",
                                  "Out": "*bf16"},
        dict(HEAD_DIM=64, BLOCK_S=ta._pow2(splits), BLOCK_D=64), num_warps=4)
