"""The KV cache: one preallocated K and V tensor per layer, indexed by slot.

Slot s of every layer holds the K/V of one token; the scheduler's `SlotAllocator` hands slots
out and the request-to-token table says which slots hold a request's positions. Slot 0
(`PAD_SLOT`) is never handed out: padded tokens may write there, and masked-out positions of a
gather read it, so it must only ever hold finite values (the pool starts zeroed).

A quantized pool (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`) keeps codes of one byte per value
and a float32 scale per (slot, head) row: value = code x scale, the scale being the row's
largest magnitude over the code's largest (127, or the fp8 format's largest finite; fp8 rows
then try three larger scales within an octave, FP8_SCALE_SHIFTS, and keep the closest).
`--kv-cache-dtype fp8` is vLLM's layout: e4m3 codes and one scale for the whole pool, 1 (vLLM's
default where a checkpoint names none), so no scale is stored (`row_scales` False): exactly half
a bf16 pool's bytes, values beyond e4m3's range (+-448) clamped. Rows are quantized on store;
the native attention kernel reads the codes in place, the SDPA paths dequantize what they
gather. Every reader sees the same dequantized values, fresh tokens included (`store` hands
them back), so chunking and caching do not change what is attended.
"""

from __future__ import annotations

import functools
import math
import mmap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from banyan.args import kv_cache_dtype_name
from banyan.kernels import fused_ops
from banyan.mem.allocator import PAD_SLOT

# --kv-cache-dtype names (args.KV_CACHE_DTYPES) -> the code dtype (None: unquantized)
CODE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8": torch.float8_e4m3fn,
}
# --kv-cache-dtype names whose pool keeps no scale per row (one for the pool, 1). Per-tensor e4m3
# at scale 1 suits Llama-family K/V (SmolLM2-135M's largest K magnitude over its 30 layers is
# ~20, V ~14, against e4m3's 448 and 2^-9): the fixed text's perplexity +0.12% (transformers,
# float32); e5m2's two mantissa bits need the per-row scale search (+3.2% without it).
UNIT_SCALE_NAMES = frozenset({"fp8"})
SCALE_BYTES = 4  # one float32 scale per (slot, head) row of K and of V


def kv_code_dtype(name: str) -> torch.dtype | None:
    """The code dtype of a --kv-cache-dtype name (None for auto); ValueError naming the field."""
    return CODE_DTYPES[kv_cache_dtype_name(name)]


def kv_row_scales(name: str) -> bool:
    """Whether the pool of a --kv-cache-dtype name keeps a scale per (slot, head) row."""
    return kv_cache_dtype_name(name) not in UNIT_SCALE_NAMES


def _check_unit_scale(code_dtype: torch.dtype | None) -> None:
    """ValueError unless `code_dtype` may go without row scales (fp8 only)."""
    if code_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("kv_cache_dtype: only fp8 codes go without row scales")


def _code_max(code_dtype: torch.dtype) -> float:
    return 127.0 if code_dtype == torch.int8 else float(torch.finfo(code_dtype).max)


def kv_bytes_per_slot(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      code_dtype: torch.dtype | None = None, row_scales: bool = True) -> int:
    """Bytes one token's K and V take over all layers (codes, and their row scales when
    quantized with them)."""
    if code_dtype is None:
        elem = torch.empty((), dtype=dtype).element_size()
        return layers * 2 * kv_heads * head_dim * elem
    return layers * 2 * kv_heads * (head_dim + (SCALE_BYTES if row_scales else 0))


def num_slots_for_bytes(
    budget: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    code_dtype: torch.dtype | None = None, row_scales: bool = True,
) -> int:
    """Slots (including the padding slot) that fit in `budget` bytes."""
    per_slot = kv_bytes_per_slot(layers, kv_heads, head_dim, dtype, code_dtype, row_scales)
    slots = budget // per_slot
    if slots < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {slots} slots; at least 2 are needed "
            f"({per_slot} bytes per token)"
        )
    return slots


# fp8 scales tried per row: the row's largest magnitude over the format's largest, times these.
# fp8's grid is the same in every binade, so a shift within one octave moves every value
# against it; the row keeps the shift with the smallest squared error, which the few largest
# values dominate, as they dominate the row's dot products. Perplexity of the fixed text with
# fp8_e4m3 K/V (float32 model, Zen 4): +0.95% -> -0.16% of the unquantized pool's; on a
# 1,510-token text +0.53% -> +0.31% (fp8_e5m2: +1.53% -> +0.89%, +2.28% -> +2.02%).
FP8_SCALE_SHIFTS = (1.0, 2 ** 0.25, 2 ** 0.5, 2 ** 0.75)


@functools.cache
def fp8_shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor(FP8_SCALE_SHIFTS, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor, code_dtype: torch.dtype, row_scales: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] float -> (codes [..., D] code_dtype, scale [...] float32), row-wise; without
    row_scales (fp8 only) the codes of x itself, clamped to the format's range, and no scale."""
    if not row_scales:
        _check_unit_scale(code_dtype)
        top = _code_max(code_dtype)
        return x.float().clamp(-top, top).to(code_dtype), None
    if code_dtype != torch.int8:
        native = fused_ops.fp8_quantize_rows(x, code_dtype, fp8_shifts(x.device))
        if native is not None:
            return native
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_(min=1e-30).div_(_code_max(code_dtype))
    if code_dtype == torch.int8:
        scaled = xf / scale.unsqueeze(-1)
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    tried = scale.unsqueeze(-1) * fp8_shifts(x.device)  # [..., S]
    codes = (xf.unsqueeze(-2) / tried.unsqueeze(-1)).to(code_dtype)  # [..., S, D]
    err = (codes.double() * tried.double().unsqueeze(-1) - xf.double().unsqueeze(-2))
    best = err.square_().sum(-1).argmin(-1, keepdim=True)  # [..., 1]: the first of equals
    picked = codes.view(torch.uint8).gather(-2, best.unsqueeze(-1).expand(*xf.shape[:-1], 1,
                                                                         xf.shape[-1]))
    return picked.squeeze(-2).view(code_dtype), tried.gather(-1, best).squeeze(-1)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                    ) -> torch.Tensor:
    """The inverse of `quantize_rows` (scale None: 1 for every row), in float32 then rounded
    to `dtype` once (fp8 on CPU in one native call, the same bits)."""
    if codes.dtype != torch.int8:
        native = fused_ops.fp8_dequantize_rows(codes, scale, dtype)
        if native is not None:
            return native
    values = codes.float()
    return (values if scale is None else values.mul_(scale.unsqueeze(-1))).to(dtype)


@dataclass(slots=True)
class LayerKV:
    """One layer of the pool: K, V [slots, KVH, D] (codes when quantized) and, for a pool
    quantized with row scales, their scales [slots, KVH] float32 (else None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def select(self, which: int, index: torch.Tensor, out: torch.Tensor,
               head_rows: bool = False) -> torch.Tensor:
        """Rows of K (which 0) or V (1) into `out` (its first n rows), dequantized to out's
        dtype. index: slots ([n] -> out [n, KVH, D]) or, head_rows, rows of the [slots * KVH]
        head-split view ([n] -> out [n, D])."""
        codes = self.k if which == 0 else self.v
        scale = self.k_scale if which == 0 else self.v_scale
        n, d = index.shape[0], codes.shape[-1]
        if head_rows:
            codes = codes.view(-1, d)
            scale = None if scale is None else scale.view(-1)
        dest = out[:n]
        if codes.dtype == out.dtype:
            return torch.index_select(codes, 0, index, out=dest)
        return dest.copy_(dequantize_rows(
            codes.index_select(0, index), None if scale is None else scale.index_select(0, index),
            torch.float32))


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On CPU in an anonymous memory mapping, which the OS fills with zeros page by page
    as it is first touched: torch.zeros writes every page up front (a 5.6 GiB default pool took
    8 s of a server's start-up, measured on Zen 3), and the memory is only taken as the cache
    fills. The tensor keeps the mapping alive."""
    if device.type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where the kernel's transparent huge pages allow it ("madvise" mode, the
        # common default): 1/512 of the page faults as the cache first fills (a private
        # mapping: shared anonymous memory is shmem, which this advice does not reach)
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVPool:
    def __init__(
        self,
        layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        code_dtype: torch.dtype | None = None,
        row_scales: bool = True,
    ) -> None:
        """dtype: the model's (what attention computes in); code_dtype: int8 / fp8 codes of a
        quantized pool, None to store `dtype` as it is; row_scales: a quantized pool's scale
        per (slot, head) row, or (False, fp8 only) one unit scale for the pool."""
        if code_dtype not in CODE_DTYPES.values():
            raise ValueError(f"kv_cache_dtype: the pool cannot store {code_dtype} codes")
        if not row_scales:
            _check_unit_scale(code_dtype)
        if num_slots < 2:
            raise ValueError(
                f"KV pool needs at least 2 slots (slot {PAD_SLOT} is padding), got {num_slots}"
            )
        self.layers = layers
        self.num_slots = num_slots
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.code_dtype = code_dtype
        self.row_scales = code_dtype is not None and row_scales
        stored = dtype if code_dtype is None else code_dtype
        # Zeroed, not empty: gathers read slot 0 (and stale slots) under a mask, and a NaN in
        # garbage memory would survive the mask (0 * NaN = NaN in the weighted sum of V).
        shape = (num_slots, kv_heads, head_dim)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            return [lazy_zeros(shape, dtype, self.device) for _ in range(layers)]

        self.k: list[torch.Tensor] = zeros(shape, stored)
        self.v: list[torch.Tensor] = zeros(shape, stored)
        scaled = self.row_scales
        self.k_scale: list[torch.Tensor] = zeros(shape[:2], torch.float32) if scaled else []
        self.v_scale: list[torch.Tensor] = zeros(shape[:2], torch.float32) if scaled else []
        # made once: every layer of every step asks for its view
        self._layers = [LayerKV(self.k[i], self.v[i], self.k_scale[i] if scaled else None,
                                self.v_scale[i] if scaled else None) for i in range(layers)]

    @classmethod
    def named(cls, layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str, kv_cache_dtype: str = "auto") -> KVPool:
        """The pool of a --kv-cache-dtype name (its codes, and whether rows keep scales)."""
        return cls(layers, num_slots, kv_heads, head_dim, dtype, device,
                   kv_code_dtype(kv_cache_dtype), kv_row_scales(kv_cache_dtype))

    @property
    def quantized(self) -> bool:
        return self.code_dtype is not None

    @property
    def kv_cache_dtype(self) -> str:
        """The --kv-cache-dtype name of this pool's storage."""
        if self.code_dtype is None:
            return "auto"
        return next(n for n, d in CODE_DTYPES.items()
                    if d == self.code_dtype and kv_row_scales(n) == self.row_scales)

    @property
    def bytes_per_slot(self) -> int:
        return kv_bytes_per_slot(self.layers, self.kv_heads, self.head_dim, self.dtype,
                                 self.code_dtype, self.row_scales)

    def layer(self, layer_id: int) -> LayerKV:
        return self._layers[layer_id]

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              seen: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [T] int64; k/v: [T, kv_heads, head_dim] -> written to layer `layer_id`.
        Returns k, v as readers of the pool will see them (dequantized when quantized; a
        caller that reads only the pool passes seen=False and gets k, v back unchanged)."""
        if self.code_dtype is None:
            self.k[layer_id].index_copy_(0, slots, k)
            self.v[layer_id].index_copy_(0, slots, v)
            return k, v
        out = []
        lk = self.layer(layer_id)
        for x, codes, scales in ((k, lk.k, lk.k_scale), (v, lk.v, lk.v_scale)):
            c, sc = quantize_rows(x, self.code_dtype, self.row_scales)
            codes.view(torch.uint8).index_copy_(0, slots, c.view(torch.uint8))  # fp8: no op
            if scales is not None and sc is not None:
                scales.index_copy_(0, slots, sc)
            out.append(dequantize_rows(c, sc, x.dtype) if seen else x)
        return out[0], out[1]

    # ---- copies in and out (the KV tier, the P/D transfer): raw bytes, codes with scales

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer, as `gather` lays them out."""
        return self.bytes_per_slot // (self.layers * 2)

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """The K/V of `slots`, copied out: uint8 [layers, 2 (k, v), n, row_bytes] on the CPU,
        a row being the heads' values (codes, then the heads' float32 scales where kept).
        What the KV tier stores and the P/D transfer sends; `scatter` takes it back."""
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        n, hd = len(index), self.kv_heads * self.head_dim
        out = torch.empty((self.layers, 2, n, self.row_bytes), dtype=torch.uint8)
        for layer in range(self.layers):
            for which, (codes, scales) in enumerate(self._parts(layer)):
                part = codes.index_select(0, index).cpu().view(n, hd).view(torch.uint8)
                out[layer, which, :, :part.shape[1]] = part
                if scales is not None:
                    out[layer, which, :, part.shape[1]:] = \
                        scales.index_select(0, index).cpu().view(torch.uint8)
        return out

    def unpack(self, data: bytes | bytearray | memoryview | torch.Tensor, count: int
               ) -> torch.Tensor:
        """Bytes `gather` made (for `count` tokens) -> the tensor `scatter` takes."""
        if isinstance(data, torch.Tensor):
            return data.view(self.layers, 2, count, self.row_bytes)
        with warnings.catch_warnings():  # a read-only buffer: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        return raw.view(self.layers, 2, count, self.row_bytes)

    def scatter(self, kv: torch.Tensor, slots: Sequence[int]) -> None:
        """kv uint8 [layers, 2, n, row_bytes] (from `gather`/`unpack`) into `slots`: a plain
        copy when the slots are one ascending run (the allocator hands out lowest-first, so
        they usually are), else an index copy."""
        first, n = slots[0], len(slots)
        run = slots[-1] - first == n - 1 and list(slots) == list(range(first, first + n))
        index = None if run else torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        kv = kv.to(self.device)
        for layer in range(self.layers):
            for which, parts in enumerate(self._parts(layer)):
                row, at = kv[layer, which], 0
                for dest in parts:  # as raw bytes per slot: any dtype, fp8 included
                    if dest is None:
                        continue
                    dest_bytes = dest.view(torch.uint8).view(self.num_slots, -1)
                    width = dest_bytes.shape[1]
                    src = row[:, at:at + width]
                    at += width
                    if index is None:
                        dest_bytes[first:first + n].copy_(src)
                    else:
                        dest_bytes.index_copy_(0, index, src.contiguous())

    def regions(self) -> list[torch.Tensor]:
        """Every tensor of the pool, each indexed by slot: K and V codes per layer, then K and
        V scales when quantized (the P/D Mooncake backend writes into them in place)."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def _parts(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(K codes, K scales), (V codes, V scales) of a layer; scales None where the pool
        keeps none per row."""
        lk = self.layer(layer)
        return (lk.k, lk.k_scale), (lk.v, lk.v_scale)
