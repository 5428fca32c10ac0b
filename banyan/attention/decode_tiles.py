"""Whether the row kernel (decodes, speculative checks, short chunks) runs its products on AMX
tiles in this process: decided once, at start-up, on a CPU with AMX and a bf16 pool.

The row kernel's vector loops run a decode group's rows over their shared prefix at ~35% of the
vdpbf16ps peak on Zen 5 (24 rows a KV head over 1,024 keys: its softmax, key transposes and sums
around the products), and on an AMX Xeon vdpbf16ps is itself a sixth of the tiles' bf16 peak
(#13: ~2,400 GFLOP/s on 2 cores through oneDNN). With its products on tiles
(kernels/cpu_attend_tiles.h) the kernel keeps its chunks, softmax and roundings. Every row of a
process takes one path (native.set_decode_tiles), so a row's bits stay those of its query and
keys, decoded alone, grouped or checked; the tile path's bits differ from the vector loops'.

Taken only once measured: the real tiles' output must match the vector loops' on random inputs
(bf16 rounding apart), then a shared-prefix decode step (the case tiles are for) and a step of
lone decodes (memory-bound: must not lose) are timed on both paths in turns, and tiles stay
unless the vector loops take the two steps clearly faster (keeps_tiles).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch

from banyan.attention.native_plan import NativePlan, plan_native
from banyan.attention.prefill_choice import alternating_medians, clearly_faster
from banyan.kernels import attention_kernels, native

logger = logging.getLogger(__name__)


def keeps_tiles(vector_s: float, tiles_s: float) -> bool:
    """A tile route's verdict (this module's, layers/gemm_tiles.py's): the tiles stay unless the
    vector loops measured clearly faster (prefill_choice.clearly_faster: a tie keeps them)."""
    return not clearly_faster(vector_s, tiles_s)


PROBE_GROUP = 3  # query heads per KV head in the probes (SmolLM2's)


@dataclass(slots=True)
class DecodeProbe:
    """One layer's decode step over a random bf16 pool: `members` requests sharing a
    `shared`-key prefix (0: each alone) plus `own` keys each, one new token apiece (`check`
    > 1: the last request's step is a check of that many tokens)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    plan: NativePlan

    @classmethod
    def make(cls, kv_heads: int, head_dim: int, members: int, shared: int, own: int,
             check: int = 1) -> DecodeProbe:
        gen = torch.Generator().manual_seed(members + shared + own)
        total = 1 + shared + members * own
        k, v = (torch.randn(total, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
                for _ in range(2))
        table = torch.zeros(members, shared + own, dtype=torch.int32)
        for i in range(members):
            table[i, :shared] = torch.arange(1, shared + 1)
            table[i, shared:] = torch.arange(1 + shared + i * own, 1 + shared + (i + 1) * own)
        new = [1] * (members - 1) + [check]
        tokens = sum(new)
        q = torch.randn(tokens, kv_heads * PROBE_GROUP, head_dim, generator=gen).to(
            torch.bfloat16)
        starts = [sum(new[:i]) for i in range(members)]
        plan = plan_native(table, list(range(members)), [shared + own - n for n in new], new,
                           starts if check > 1 else None)
        return cls(q, k, v, table, plan)

    def run(self) -> torch.Tensor:
        p = self.plan
        out = torch.empty_like(self.q)
        return attention_kernels.paged_attention(self.q, self.k, self.v, self.table, p.req_row,
                                                 p.req_len, p.q_start, p.n_new, p.order,
                                                 p.group_start, p.group_prefix,
                                                 self.q.shape[-1]**-0.5, out)


ASK = -1  # native.set_decode_tiles: a value other than 0, 1, 2 only asks the mode in effect


@contextmanager
def tiles_mode(mode: int, setter: Callable[[int], int] = native.set_decode_tiles
               ) -> Iterator[None]:
    """A kernel's products in `mode` inside the block (setter: the row kernel's by default,
    native.set_decode_tiles, or another kernel's setter of the same contract), the process's
    mode put back after; a mode this build or CPU refuses raises."""
    before = setter(ASK)
    try:
        if setter(mode) != mode:
            raise RuntimeError(f"tile mode {mode} refused here ({setter.__name__})")
        yield
    finally:
        setter(before)


def tile_modes_here() -> list[int]:
    """The tile modes this build and CPU run, for the row kernel and the prefill kernel alike:
    1 (tiles emulated in memory, for tests) where the tile paths are built (AVX512-BF16), and 2
    where Linux also granted this process AMX's tile state."""
    return [m for m in (1, 2) if native.prefill_tiles() >= m]


def outputs_in_mode(probe: DecodeProbe, mode: int) -> torch.Tensor:
    """The probe's output with the row kernel's products in `mode`."""
    with tiles_mode(mode):
        return probe.run().float()


def decode_tiles_agree(kv_heads: int, head_dim: int, mode: int = 2) -> bool:
    """Whether the row kernel's output on tiles (`mode`) is its vector loops' on random inputs
    (a group over a shared prefix with a check among its members, and lone decodes), to within
    what the two paths' roundings allow."""
    for probe in (DecodeProbe.make(kv_heads, head_dim, 5, 300, 40, check=6),
                  DecodeProbe.make(kv_heads, head_dim, 3, 0, 290)):
        want, got = outputs_in_mode(probe, 0), outputs_in_mode(probe, mode)
        if not (bool(torch.isfinite(got).all()) and
                torch.allclose(got, want, atol=3e-2, rtol=3e-2)):
            return False
    return True


def time_decode_paths(kv_heads: int, head_dim: int, mode: int = 2,
                      rounds: int = 5) -> tuple[float, float]:
    """Median seconds of a shared-prefix decode step (8 members over 1,024 keys + 100 own) plus
    a step of 16 lone decodes over 200 keys, on the vector loops and in `mode` (in turns)."""
    probes = (DecodeProbe.make(kv_heads, head_dim, 8, 1024, 100),
              DecodeProbe.make(kv_heads, head_dim, 16, 0, 200))

    def step(m: int) -> None:
        with tiles_mode(m):
            for p in probes:
                p.run()

    vector_s, tiles_s = alternating_medians([lambda: step(0), lambda: step(mode)], rounds)
    return vector_s, tiles_s


@cache
def decode_tiles_route(kv_heads: int, head_dim: int, dtype: torch.dtype,
                       code_dtype: torch.dtype | None) -> int:
    """The row kernel's mode for this process (module docstring) on a CPU with AMX and a bf16
    pool, set and returned: 2 where the tiles check out and measure faster, else 0; elsewhere 0,
    the process's mode left as it is (the vector loops, or the emulated tiles of a test)."""
    if not (native.amx_here() and native.prefill_tiles() == 2 and dtype == torch.bfloat16
            and code_dtype in (None, dtype) and head_dim % 32 == 0):
        return 0
    if not decode_tiles_agree(kv_heads, head_dim):
        logger.warning("decode attention on AMX tiles: output differs from the vector loops', "
                       "not used")
        return native.set_decode_tiles(0)
    vector_s, tiles_s = time_decode_paths(kv_heads, head_dim)
    mode = 2 if keeps_tiles(vector_s, tiles_s) else 0
    logger.info("decode attention on AMX tiles: checked; a shared-prefix and a lone decode step "
                "took %.2f ms on tiles, %.2f ms on the vector loops: %s", tiles_s * 1e3,
                vector_s * 1e3, "tiles in use" if mode else "vector loops kept")
    return native.set_decode_tiles(mode)
