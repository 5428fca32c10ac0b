"""Our Llama-family model + loader + runner against Hugging Face transformers (float32 reference).

Every architecture of the shared `model_dirs` fixture (llama with llama3 RoPE scaling, mistral
with MQA and an independent head_dim, qwen2 with q/k/v bias and tied embeddings, qwen3 with q/k
norm) must give HF's logits at every position: whole prompt in one step, in chunks over a cached
prefix followed by decodes, and inside mixed batches of other requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan.batch import RowPrefix
from banyan.demo import build_random_model
from banyan.kernels import fused_ops
from banyan.layers.linear import Linear, PackedBf16Method, PairsBf16Method
from banyan.mem.allocator import SlotAllocator
from tests.model_helpers import (
    ARCHS,
    Seq,
    assert_close,
    hf_logits,
    make_runner,
    random_ids,
    run_step,
)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_prompt_matches_hf(arch: str, model_dirs: dict[str, Path]) -> None:
    path = model_dirs[arch]
    runner = make_runner(path)
    ids = random_ids(90, seed=1)  # past llama's original_max_position_embeddings=64
    ref = hf_logits(path, ids)
    (got,) = run_step(runner, SlotAllocator(runner.num_slots), [(Seq(0, ids), len(ids))])
    assert_close(got, ref, what=arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_pytorch_element_wise_path_matches_hf(
    arch: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the fused CPU kernels (norms, RoPE, SiLU) refused: the PyTorch ops that
    run on other devices and dtypes give HF's logits too."""
    monkeypatch.setattr(fused_ops, "_kernel", lambda name, x: None)
    path = model_dirs[arch]
    runner = make_runner(path)
    ids = random_ids(40, seed=5)
    ref = hf_logits(path, ids)
    alloc = SlotAllocator(runner.num_slots)
    seq = Seq(0, ids)
    (got,) = run_step(runner, alloc, [(seq, len(ids) - 1)])
    assert_close(got, ref[:-1], what=arch)
    (got,) = run_step(runner, alloc, [(seq, 1)])  # a decode too
    assert_close(got, ref[-1:], what=arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_then_decodes_match_hf(arch: str, model_dirs: dict[str, Path]) -> None:
    path = model_dirs[arch]
    runner = make_runner(path)
    ids = random_ids(80, seed=2)
    ref = hf_logits(path, ids)
    alloc = SlotAllocator(runner.num_slots)
    seq = Seq(row=3, tokens=ids)
    pos = 0
    for n in [17, 1, 30, 12] + [1] * 20:  # chunks over a cached prefix, then decodes
        (got,) = run_step(runner, alloc, [(seq, n)])
        assert_close(got, ref[pos : pos + n], what=f"{arch} positions [{pos}, {pos + n})")
        pos += n
    assert pos == len(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_each_alone(arch: str, model_dirs: dict[str, Path]) -> None:
    path = model_dirs[arch]
    runner = make_runner(path)
    alloc = SlotAllocator(runner.num_slots)
    a = Seq(0, random_ids(40, seed=3))
    b = Seq(5, random_ids(33, seed=4))
    c = Seq(2, random_ids(12, seed=5))
    # d shares a's first 16 tokens: a prefix-cache hit handed over as a RowPrefix.
    d = Seq(7, a.tokens[:16] + random_ids(14, seed=6))
    e = Seq(1, random_ids(6, seed=7))
    refs = {id(s): hf_logits(path, s.tokens) for s in (a, b, c, d, e)}
    got: dict[int, list[torch.Tensor]] = {id(s): [] for s in (a, b, c, d, e)}

    def step(work: list[tuple[Seq, int]], prefixes: list[RowPrefix] | None = None) -> None:
        for (s, _), logits in zip(work, run_step(runner, alloc, work, prefixes), strict=True):
            got[id(s)].append(logits)

    step([(a, 20), (b, 10), (c, 3)])  # extends only
    step([(c, 1), (a, 20), (b, 1), (e, 1)])  # decodes around an extend (not contiguous)
    d.slots = a.slots[:16]
    step([(b, 1), (c, 1), (d, 6), (e, 1)], [RowPrefix(d.row, list(d.slots))])
    for _ in range(3):  # decode-only steps, different context lengths
        step([(e, 1), (b, 1), (c, 1), (d, 1)])
    step([(d, len(d.tokens) - len(d.slots)), (b, 1), (c, 1)])
    for s in (a, b, c, d, e):
        n = len(s.slots)
        start = 16 if s is d else 0
        assert_close(torch.cat(got[id(s)]), refs[id(s)][start:n], what=f"{arch} row {s.row}")


# ------------------------------------------------------------------ more variants of the family

VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "llama-linear-bias": (
        "llama",
        dict(
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            attention_bias=True,
            mlp_bias=True,
            num_attention_heads=4,
            num_key_value_heads=4,
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
        ),
    ),
    "qwen2-untied-mqa": (
        "qwen2",
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    ),
}


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    return {
        name: build_random_model(
            tmp_path_factory.mktemp(name),
            arch,
            tokenizer_dir=tokenizer_dir,
            seed=11,
            **common,
            **extra,
        )  # type: ignore[arg-type]
        for name, (arch, extra) in VARIANTS.items()
    }


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_match_hf(name: str, variant_dirs: dict[str, Path]) -> None:
    path = variant_dirs[name]
    runner = make_runner(path)
    ids = random_ids(75, seed=8)
    ref = hf_logits(path, ids)
    seq, alloc, pos = Seq(0, ids), SlotAllocator(runner.num_slots), 0
    for n in (70, 1, 1, 3):
        (got,) = run_step(runner, alloc, [(seq, n)])
        assert_close(got, ref[pos : pos + n], what=f"{name} [{pos}, {pos + n})")
        pos += n


def test_bf16_load(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    runner = make_runner(path, dtype="bfloat16")
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert (qkv.packed if isinstance(qkv.method, PackedBf16Method) else qkv.weight).dtype \
        == torch.bfloat16
    assert runner.model.rotary.inv_freq.dtype == torch.float32
    assert runner.pool.k[0].dtype == torch.bfloat16
    ids = random_ids(40, seed=10)
    seq, alloc = Seq(0, ids), SlotAllocator(runner.num_slots)
    got = torch.cat(run_step(runner, alloc, [(seq, 36)]) + run_step(runner, alloc, [(seq, 4)]))
    assert got.dtype == torch.float32
    assert_close(got, hf_logits(path, ids), rel=5e-2, what="bf16 vs fp32")


def test_bf16_prepacked_weights_give_identical_logits(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = model_dirs["qwen2"]  # biases on q/k/v: the packed path carries them
    if not PackedBf16Method.available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this torch build has no oneDNN weight packing")
    ids = random_ids(40, seed=11)
    logits = []
    for packing in (True, False):
        if not packing:
            monkeypatch.setattr(PackedBf16Method, "available", lambda *a: False)
        # (--linear-kernel torch: `auto` takes the native bf16 kernels on AVX512-BF16 CPUs with
        # or without oneDNN's packing, which this test turns off)
        runner = make_runner(path, dtype="bfloat16", linear_kernel="torch")
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)
                   and isinstance(m.method, (PackedBf16Method, PairsBf16Method))]
        assert len(linears) == (4 * runner.model_config.layers + 1 if packing else 0)
        seq, alloc = Seq(0, ids), SlotAllocator(runner.num_slots)
        logits.append(torch.cat(run_step(runner, alloc, [(seq, 36)])
                                + run_step(runner, alloc, [(seq, 4)])))
    assert torch.equal(logits[0], logits[1])


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_matches_fp32_reference(arch: str, model_dirs: dict[str, Path]) -> None:
    path = model_dirs[arch]
    runner = make_runner(path, dtype="bfloat16", device="cuda")
    ids = random_ids(70, seed=12)
    ref = hf_logits(path, ids)
    a, b = Seq(0, ids), Seq(1, random_ids(20, seed=13))
    alloc = SlotAllocator(runner.num_slots)
    chunks = run_step(runner, alloc, [(a, 50), (b, 20)])[:1]
    for _ in range(20):
        chunks.append(run_step(runner, alloc, [(a, 1)])[0])
    got = torch.cat(chunks).cpu()
    assert_close(got, ref, rel=5e-2, what=f"cuda bf16 {arch}")
