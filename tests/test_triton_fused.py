"""The fused element-wise Triton kernels (kernels/triton_fused.py) against the PyTorch
composition the layers run otherwise. Without a GPU they run under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/triton_device.py before triton is first imported); on a
CUDA machine the same tests run the compiled kernels.

Covered: widths 64 (one block), 576 (SmolLM2's hidden, not a power of two) and 1536 (its MLP,
several column blocks in SiLU-and-mul); 1, 5 and 33 rows; head_dim 64 and 24, and 32 with
Qwen3's q/k head norms; float32 and bfloat16. RoPE must be bit-identical in both; the add before
the norm too; the norm and SiLU within one rounding step (their reductions and exp are other
implementations). Except in bfloat16 under the interpreter: its float32 -> bfloat16 cast truncates
where a GPU's (and torch's) rounds to nearest, so there the values are checked within three bf16
steps only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.triton_device import DEVICE, skip_if_compiled_without_gpu

pytest.importorskip("triton")

from banyan import Engine, SamplingParams  # noqa: E402
from banyan.kernels import fused_ops, triton_fused  # noqa: E402
from banyan.layers.norm import RMSNorm  # noqa: E402
from banyan.layers.rotary import apply_rotary  # noqa: E402

skip_if_compiled_without_gpu()

DTYPES = [torch.float32, torch.bfloat16]
ONE_ROUNDING = {torch.float32: 2e-6, torch.bfloat16: 2**-7}  # relative: one step of the dtype


def exact(dtype: torch.dtype) -> bool:
    """Whether bit-for-bit checks hold here (see the module doc)."""
    return DEVICE == "cuda" or dtype == torch.float32


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    if exact(want.dtype):
        assert torch.equal(got, want)
    else:
        # (a difference of two truncated products can cancel: bounded by the data's scale)
        diff = (got.float() - want.float()).abs()
        assert float(diff.max()) <= 3 * 2**-7 * float(want.float().abs().max())


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or apart by at most one rounding step of the dtype at each element's size; and
    nearly all elements exactly equal."""
    diff = (got.float() - want.float()).abs()
    # (truncating twice, the interpreter can land a little past two steps)
    steps = 1 if exact(want.dtype) else 3
    bound = steps * ONE_ROUNDING[want.dtype] * want.float().abs().clamp_min(1e-3)
    assert bool((diff <= bound).all()), float((diff / bound).max())
    if want.dtype == torch.bfloat16 and exact(want.dtype):
        # a last-bit change of a float32 intermediate rarely moves a bf16 rounding
        assert float((got == want).float().mean()) >= 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 576), (33, 1536)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype: torch.dtype, rows: int, n: int, with_residual: bool) -> None:
    norm = RMSNorm(n, 1e-5).to(DEVICE)
    norm.weight.data = rand(n, dtype=dtype, seed=1) * 0.5
    x = rand(rows, n, dtype=dtype, seed=2)
    residual = rand(rows, n, dtype=dtype, seed=3) if with_residual else None
    stream_want = x if residual is None else residual + x
    want = norm(stream_want)  # the PyTorch composition (HF's order)
    mine = None if residual is None else residual.clone()
    got, stream = triton_fused.add_rms_norm(x, mine, norm.weight.data, 1e-5)
    assert_same(stream, stream_want)  # the add rounds as torch's
    if mine is not None:
        assert stream.data_ptr() == mine.data_ptr()  # updated in place
    assert_within_one_rounding(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 576), (33, 1536)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    gate_up = rand(rows, 2 * inter, dtype=dtype, seed=4)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_one_rounding(triton_fused.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 24)])
def test_rope_is_bit_identical(dtype: torch.dtype, heads: int, kv_heads: int,
                               head_dim: int) -> None:
    rows = 7
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rand(rows, width, dtype=dtype, seed=5)
    angles = torch.rand(rows, head_dim // 2, generator=torch.Generator().manual_seed(6)) * 50
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    want_q, want_k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
    q, k = triton_fused.rope_qk(qkv, cos, sin, heads, kv_heads, head_dim)
    assert q.is_contiguous() and k.is_contiguous()
    assert_same(q, want_q)
    assert_same(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_qwen3_head_norms(dtype: torch.dtype) -> None:
    """Each q/k head RMS-normed by its own weights before the rotation, as the layer's
    RMSNorm modules do it."""
    rows, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = rand(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    angles = torch.rand(rows, head_dim // 2, generator=torch.Generator().manual_seed(8)) * 50
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE), RMSNorm(head_dim, 1e-6).to(DEVICE)
    q_norm.weight.data = rand(head_dim, dtype=dtype, seed=9)
    k_norm.weight.data = rand(head_dim, dtype=dtype, seed=10)
    q, k = qkv[:, : (heads + kv_heads) * head_dim].split([heads * head_dim,
                                                         kv_heads * head_dim], dim=-1)
    with torch.no_grad():
        want_q = apply_rotary(q_norm(q.reshape(rows, heads, head_dim)), cos, sin)
        want_k = apply_rotary(k_norm(k.reshape(rows, kv_heads, head_dim)), cos, sin)
    got_q, got_k = triton_fused.rope_qk(qkv, cos, sin, heads, kv_heads, head_dim,
                                        q_norm.weight.data, k_norm.weight.data, 1e-6)
    # the norm's sum of squares is reduced in another order: within a rounding step or two
    # of the result's scale (a rotation mixes two rounded halves)
    scale = float(want_q.float().abs().max())
    tol = 4 * ONE_ROUNDING[dtype] * scale if exact(dtype) else 6 * 2**-7 * scale
    assert float((got_q.float() - want_q.float()).abs().max()) <= tol
    assert float((got_k.float() - want_k.float()).abs().max()) <= tol


def test_engine_with_the_triton_kernels_gives_the_same_tokens(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers dispatch to them through fused_ops (on CPU here, the switch forced) and the
    greedy tokens stay those of the usual path (float32; SDPA attention, so every layer runs
    the Python modules rather than the CPU's native layer stack)."""
    prompts = [[5, 9, 14, 3], list(range(20, 90))]
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        with Engine(str(llama_dir), dtype="float32", device=DEVICE, disable_tqdm=True,
                    attention_backend="sdpa") as engine:
            return [o.output_ids for o in engine.generate(input_ids=prompts,
                                                          sampling_params=params)]

    plain = tokens()
    calls: list[str] = []

    def forced(x: torch.Tensor) -> object:
        calls.append(str(x.device))
        return triton_fused

    monkeypatch.setattr(fused_ops, "_gpu_kernels", forced)
    assert tokens() == plain
    assert calls  # the Triton kernels did run
