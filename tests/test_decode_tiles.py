"""The row kernel's products on tiles (kernels/cpu_attend_tiles.h: decodes, groups over a shared
prefix, speculative checks), for bf16 queries over a bf16 pool: the tiles emulated in memory on
every CPU with AVX512-BF16 (their layouts, strides and the blocks of 32 rows and keys checked
everywhere), AMX's own where the CPU grants them. Against a float64 softmax attention; and the
row kernel's rule on tiles: a row's bits depend on its query and keys alone (decoded alone, in
a batch, grouped, in a check, on 1 or 2 threads)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from banyan.attention.decode_tiles import (
    ASK,
    DecodeProbe,
    decode_tiles_agree,
    keeps_tiles,
    outputs_in_mode,
    tile_modes_here,
    tiles_mode,
)
from banyan.attention import prefill_choice
from banyan.attention.native_plan import plan_native
from banyan.kernels import native
from tests.test_native_attention import (
    _attend,
    test_a_decode_grouped_by_a_shared_prefix_gets_the_bits_it_has_alone as grouped_bits,
    test_a_token_gets_the_same_bits_decoded_alone_in_a_batch_or_in_a_check as check_bits,
)

def _tiles_built() -> bool:
    if native.load() is None:
        return False
    try:
        with tiles_mode(1):
            return True
    except RuntimeError:
        return False


pytestmark = pytest.mark.skipif(not _tiles_built(),
                                reason="no tile path in this build (needs AVX512-BF16)")
MODES = tile_modes_here()


@pytest.fixture(params=MODES, ids=lambda m: {1: "emulated", 2: "amx"}[m])
def tile_mode(request: pytest.FixtureRequest) -> Iterator[int]:
    with tiles_mode(request.param):
        yield request.param


def _step(kv_heads: int, heads: int, dim: int, shared: int, owns: list[int],
          new: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of requests sharing `shared` prefix keys (0: none) plus owns[i] keys each, the
    last new[i] of them new: (the kernel's output, float64 reference, the vector loops'
    output)."""
    gen = torch.Generator().manual_seed(seed)
    total = 1 + shared + sum(owns)
    k, v = (torch.randn(total, kv_heads, dim, generator=gen).to(torch.bfloat16)
            for _ in range(2))
    q = torch.randn(sum(new), heads, dim, generator=gen).to(torch.bfloat16)
    table = torch.zeros(len(owns), shared + max(owns), dtype=torch.int32)
    start = 1 + shared
    for i, own in enumerate(owns):
        table[i, :shared] = torch.arange(1, shared + 1)
        table[i, shared:shared + own] = torch.arange(start, start + own)
        start += own
    lens = [shared + own for own in owns]
    starts = [sum(new[:i]) for i in range(len(owns))]
    plan = plan_native(table, list(range(len(owns))), [n - e for n, e in zip(lens, new)], new,
                       starts)
    scale = dim**-0.5
    probe = DecodeProbe(q, k, v, table, plan)
    mode = native.set_decode_tiles(ASK)
    got, vector = outputs_in_mode(probe, mode), outputs_in_mode(probe, 0)
    want = torch.empty(q.shape, dtype=torch.float64)
    kd, vd, g = k.double(), v.double(), heads // kv_heads
    for i, n in enumerate(lens):
        for t in range(new[i]):
            keys = table[i, :n - new[i] + t + 1].long()
            for h in range(heads):
                s = kd[keys, h // g] @ q[starts[i] + t, h].double() * scale
                want[starts[i] + t, h] = torch.softmax(s, 0) @ vd[keys, h // g]
    return got, want, vector


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (6, 2, 96)])
@pytest.mark.parametrize("case", ["lone", "group", "checks"])
def test_tile_rows_match_float64(tile_mode: int, heads: int, kv_heads: int, dim: int,
                                 case: str) -> None:
    """Lone decodes around the 16-key block and the 128-key chunk (and one long enough for the
    lone request's parts), a group over a shared prefix with members of 1 to 600 keys, and
    checks of up to 13 tokens beside decodes (up to 39 rows a KV head: two blocks of 32)."""
    shared, owns, new = {
        "lone": (0, [1, 15, 16, 17, 40, 127, 129, 300], [1] * 8),
        "group": (300, [1, 33, 256, 600, 7], [1] * 5),
        "checks": (257, [20, 90, 13], [5, 1, 13]),
    }[case]
    got, want, vector = _step(kv_heads, heads, dim, shared, owns, new, seed=dim + len(case))
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, atol=2e-2, rtol=0), (got.double() - want).abs().max()
    # as close to the float64 result as the vector loops are, each rounding to bf16 its way
    assert (got.double() - want).abs().max() <= 2 * (vector.double() - want).abs().max() + 1e-3


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("n", [200, 420, 600, 1000])
def test_a_token_has_the_same_bits_alone_batched_or_checked_on_tiles(
        tile_mode: int, heads: int, kv_heads: int, dim: int, n: int) -> None:
    """The row kernel's rule with its products on tiles: a 13-token check's rows, the same
    tokens as decodes of one step and each decoded alone, on 1 and 2 threads, bit for bit."""
    check_bits(heads, kv_heads, dim, torch.bfloat16, False, n)  # (tiles: bf16 pools only)


@pytest.mark.parametrize("shared", [300, 1061])
def test_a_grouped_decode_has_the_bits_it_has_alone_on_tiles(tile_mode: int, shared: int) -> None:
    """... and a decode group's members over their shared prefix (and own keys of 1 to 700)."""
    grouped_bits(9, 3, 64, torch.bfloat16, shared, False)


@pytest.mark.parametrize("layout", ["run", "strided", "shuffled"])
def test_a_lone_decode_has_its_bits_however_its_slots_step_on_tiles(tile_mode: int,
                                                                    layout: str) -> None:
    """A call of few rows a KV head (a lone decode's 3) scores each block of 16 keys whose
    slots step evenly as S^T, read from the pool in place, and any other block as S from the
    keys transposed; a 13-token check's 39 rows take S throughout. Each decode of the check's
    tokens has the check's bits, for a prompt's run of slots, a prompt then decoded tokens at a
    batch's stride (blocks of both kinds, one straddling them), and shuffled slots."""
    gen = torch.Generator().manual_seed(len(layout))
    n, e, stride = 300, 13, 64
    slots = {"run": torch.arange(1, n + 1),
             "strided": torch.cat([torch.arange(1, 201), 201 + stride * torch.arange(n - 200)]),
             "shuffled": 1 + torch.randperm(n * stride, generator=gen)[:n]}[layout]
    k, v = (torch.randn(n * stride + 1, 3, 64, generator=gen).to(torch.bfloat16)
            for _ in range(2))
    q = torch.randn(e, 9, 64, generator=gen).to(torch.bfloat16)
    table = slots.to(torch.int32)[None]
    check = _attend(q, k, v, table, [(n, e)])
    alone = torch.cat([_attend(q[t:t + 1].contiguous(), k, v, table, [(n - e + 1 + t, 1)])
                       for t in range(e)])
    assert torch.equal(alone, check)
    kd, vd = k.double(), v.double()
    for t in (0, e - 1):  # and the attention itself, against float64
        keys = slots[:n - e + 1 + t]
        for h in range(9):
            s = kd[keys, h // 3] @ q[t, h].double() * 0.125
            want = torch.softmax(s, 0) @ vd[keys, h // 3]
            assert torch.allclose(check[t, h].double(), want, atol=2e-2, rtol=0)


def test_tiles_differ_from_the_vector_loops_only_by_rounding(tile_mode: int) -> None:
    """What the start-up check of an AMX CPU asks of the real tiles (decode_tiles.py), here of
    the tiles in use."""
    assert decode_tiles_agree(3, 64, mode=tile_mode)


def test_the_emulated_tiles_are_the_path_taken() -> None:
    """Scores whose sum order shows: queries of ones against the first shared key (2^24, 0, 1,
    -2^24 in its first dims), every other key zero. The emulated tiles sum as the SDM defines
    tdpbf16ps (the even dims' products and the odd dims' apart: 2^24 + 1 rounds back, -2^24
    cancels it, a score of 0); the vector loops' vdpbf16ps a pair at a time (1). Only that
    key's value is not zero, so its weight shows in every row and check of the step (random
    inputs' differences mostly vanish in the outputs' rounding to bf16)."""
    if 1 not in tile_modes_here():
        pytest.skip("no emulated tiles")
    probe = DecodeProbe.make(3, 64, 5, 300, 40, check=6)
    probe.q.fill_(1.0)
    probe.k.zero_()
    probe.v.zero_()
    probe.k[1, :, :4] = torch.tensor([2.0**24, 0.0, 1.0, -2.0**24])
    probe.v[1] = 64.0
    tiles, vector = outputs_in_mode(probe, 1).float(), outputs_in_mode(probe, 0).float()
    keys = 340  # (the shared 300, the own 40)
    weight = (1 / keys, torch.e ** 0.125 / (keys - 1 + torch.e ** 0.125))  # scores 0, 1 / 8
    for rows, want in ((tiles, weight[0]), (vector, weight[1])):
        assert torch.allclose(rows[:4], torch.full_like(rows[:4], 64 * want), rtol=1e-2)


def test_head_dims_the_tiles_cannot_take_stay_on_the_vector_loops(tile_mode: int) -> None:
    """A head dim that is not whole 64-byte tile rows (24) runs the vector loops in any mode:
    the same bits as mode 0."""
    probe = DecodeProbe.make(2, 24, 3, 40, 20, check=4)
    assert torch.equal(outputs_in_mode(probe, tile_mode), outputs_in_mode(probe, 0))


def test_amx_tiles_are_refused_where_the_cpu_has_none() -> None:
    """Mode 2 runs AMX instructions: where Linux granted no tile state (no AMX), it is refused
    and the mode in effect stays."""
    with tiles_mode(0):
        assert native.set_decode_tiles(2) == (2 if native.prefill_tiles() == 2 else 0)
        assert native.set_decode_tiles(7) == native.set_decode_tiles(ASK)


def test_amx_is_granted_exactly_where_the_cpu_has_it() -> None:
    """banyan_amx_state (cpu_amx_check.cpp): on a CPU with AMX-BF16, CPUID, Linux's grant and
    a first tile block run in a child process, exact against the emulated tiles, let the tile
    paths run AMX's instructions; anywhere else CPUID already says no."""
    lib = native.load()
    assert lib is not None
    state = lib.banyan_amx_state()
    assert (state == 4) == native.amx_here(), prefill_choice.amx_refusal()
    assert (native.prefill_tiles() == 2) == (state == 4)
    if not native.amx_here():
        assert state == 0 and "CPUID" in prefill_choice.amx_refusal()


def test_the_first_tile_blocks_check_tells_a_fault_and_a_wrong_output() -> None:
    """The check's child process, with the emulated tiles in place of AMX's: their block is
    the one expected (granted); a child killed by SIGILL, as a bad encoding would be, is a
    fault, not the end of this process; one output changed is a wrong block."""
    lib = native.load()
    assert lib is not None
    assert [lib.banyan_amx_check_plumbing(how) for how in (0, 1, 2)] == [4, 2, 3]


def test_the_start_up_probes_time_their_paths_in_turns() -> None:
    # (the VM's speed drifts 2-3x within minutes: one path's rounds all before the other's
    # could crown the slower path)
    calls: list[str] = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    medians = prefill_choice.alternating_medians(fns, 4)
    assert calls == ["a", "b"] + ["a", "b", "b", "a"] * 2  # warm-ups, then turns
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_a_probe_keeps_the_tiles_unless_the_vector_loops_are_clearly_faster() -> None:
    assert keeps_tiles(0.02399, 0.02399)  # a tie: both paths time-sliced by other processes
    assert keeps_tiles(2.07e-3, 0.62e-3)  # the GEMM probe on an idle AMX Xeon
    assert keeps_tiles(1.0, 1.05)  # within the margin
    assert not keeps_tiles(0.5, 1.0)  # a CPU whose tiles are slow
