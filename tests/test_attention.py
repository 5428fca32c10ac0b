"""The torch attention backend against a naive per-request softmax attention."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from banyan.attention.torch_backend import SdpaBackend
from banyan.batch import ForwardBatch
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    # q: [n, H, D] at positions prefix.., k/v: [prefix + n, KVH, D] -> [n, H, D]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q, k) / math.sqrt(q.shape[-1])
    n, s = q.shape[0], k.shape[0]
    allowed = torch.arange(s)[None, :] <= (prefix + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_step_matches_naive(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    D, layers = 8, 2
    pool = KVPool(layers, 200, kv_heads, D, torch.float32, "cpu")
    table = ReqToTokenTable(6, 64, "cpu")
    backend = SdpaBackend(pool, table)
    # Per row: full K/V history (prefix already cached in the pool, plus this step's new tokens).
    prefix_lens = [5, 0, 9, 0, 3, 20]
    extend_lens = [1, 7, 1, 1, 4, 1]  # decodes at 0, 2, 3, 5 (not contiguous), extends between
    rows = [4, 1, 0, 5, 2, 3]
    next_slot, hist = 1, []
    for r, p, n in zip(rows, prefix_lens, extend_lens, strict=True):
        slots = torch.arange(next_slot, next_slot + p + n)
        next_slot += p + n
        table.table[r, : p + n] = slots.int()
        keys = [torch.randn(p + n, kv_heads, D) for _ in range(layers)]
        vals = [torch.randn(p + n, kv_heads, D) for _ in range(layers)]
        for layer in range(layers):  # the cached prefix
            pool.k[layer][slots[:p]] = keys[layer][:p]
            pool.v[layer][slots[:p]] = vals[layer][:p]
        hist.append((slots, keys, vals))
    out_slots = torch.cat([s[p:] for (s, _, _), p in zip(hist, prefix_lens, strict=True)])
    batch = ForwardBatch(
        rows=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        input_ids=[0] * len(out_slots),
        out_slots=out_slots.tolist(),
    )
    meta = backend.plan(batch, out_slots)
    for layer in range(layers):
        q = torch.randn(len(out_slots), heads, D)
        k = torch.cat([ks[layer][p:] for (_, ks, _), p in zip(hist, prefix_lens, strict=True)])
        v = torch.cat([vs[layer][p:] for (_, _, vs), p in zip(hist, prefix_lens, strict=True)])
        out = backend.forward(q, k, v, layer, meta)
        start = 0
        for (slots, ks, vs), p, n in zip(hist, prefix_lens, extend_lens, strict=True):
            want = naive(q[start : start + n], ks[layer], vs[layer], p)
            torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
            assert torch.equal(pool.k[layer][slots[p:]], ks[layer][p:])  # stored
            start += n


def test_decode_only_step_is_batched() -> None:
    pool = KVPool(1, 32, 2, 4, torch.float32, "cpu")
    table = ReqToTokenTable(3, 16, "cpu")
    backend = SdpaBackend(pool, table)
    table.table[0, :3] = torch.tensor([1, 2, 3], dtype=torch.int32)
    table.table[2, :6] = torch.tensor([4, 5, 6, 7, 8, 9], dtype=torch.int32)
    batch = ForwardBatch(
        rows=[0, 2], prefix_lens=[2, 5], extend_lens=[1, 1], input_ids=[0, 0], out_slots=[3, 9]
    )
    meta = backend.plan(batch, torch.tensor([3, 9]))
    assert meta.dec_count == 2 and meta.dec_len == 6 and meta.extends == []
    assert meta.dec_tokens == slice(0, 2)
    assert meta.dec_kv_index.tolist() == [1, 2, 3, 0, 0, 0, 4, 5, 6, 7, 8, 9]
    assert meta.dec_mask.view(2, 6).sum(1).tolist() == [3, 6]


def test_registry_names_auto_and_errors() -> None:
    from banyan.attention import CpuNativeBackend, backend_names, create_backend
    from banyan.kernels import native

    assert {"sdpa", "cpu-native"} <= set(backend_names())
    pool = KVPool(2, 64, 2, 16, torch.float32, torch.device("cpu"))
    table = ReqToTokenTable(4, 32, torch.device("cpu"))
    assert isinstance(create_backend("sdpa", pool, table), SdpaBackend)
    auto = create_backend("auto", pool, table)
    assert auto.name == ("cpu-native" if native.load() is not None else "sdpa")
    assert isinstance(auto, CpuNativeBackend) == (auto.name == "cpu-native")
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        create_backend("flash", pool, table)
    half = KVPool(2, 64, 2, 16, torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not run on cpu"):
        create_backend("cpu-native", half, table)


def test_engine_on_each_backend_matches_transformers(llama_dir: Path) -> None:
    from banyan import Engine, SamplingParams
    from tests.hf_reference import hf_greedy

    prompts = [[5 + i for i in range(n)] for n in (3, 40, 300)]
    expected = [hf_greedy(llama_dir, p, 8) for p in prompts]
    from banyan.kernels import native

    for name in ("sdpa", "cpu-native") if native.load() is not None else ("sdpa",):
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    attention_backend=name) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
                max_new_tokens=8, temperature=0.0))
            assert [o.output_ids for o in outs] == expected, name
