"""The native layer stack (models/native_stack.py): a small step's decoder layers in one call give
bit for bit the hidden states of the model's own per-op forward, on every test architecture
(bias, q/k norms, MQA, tied heads), for every projection kernel (skinny float32, int8, int4,
GGUF Q8_0 / Q4_1 / Q4_K blocks; skinny bf16 in a bf16 model), for decodes alone, grouped by a
shared prefix, mixed with short extends, and beside extends on the prefill kernel; and it stands
aside where a piece has no native kernel."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from banyan.attention.cpu_native import CpuNativeBackend
from banyan.attention.decode_tiles import tile_modes_here
from banyan.attention.native_plan import MAX_NATIVE_EXTEND
from banyan.batch import RowPrefix
from banyan.kernels import native
from banyan.kernels.native import bf16_gemm_here
from banyan.layers.linear import Linear, SkinnyBf16Method
from banyan.layers.quant import dequantize_in_place
from banyan.mem.allocator import SlotAllocator
from banyan.model_files import resolve_model_dir
from banyan.models import native_stack
from banyan.models.native_stack import (GEMM_MAX_TOKENS, MAX_TOKENS, STACK_OPS,
                                        NativeLayerStack)
from banyan.runner.model_runner import ModelRunner
from banyan.sampling.greedy import argmax_rows
from tests.model_helpers import ARCHS, Seq, build_batch, make_runner, random_ids

pytestmark = pytest.mark.skipif(native.load() is None, reason="native CPU kernels unavailable")


def _every_extend_native(runner: ModelRunner) -> NativeLayerStack:
    """The runner with the kernel taking extends too (on AVX2 CPUs it takes only decodes),
    so short extends go through the stack here as they do on AVX-512 machines."""
    runner.backend = CpuNativeBackend(runner.pool, runner.table, max_extend=MAX_NATIVE_EXTEND)
    stack = NativeLayerStack.build(runner.model, runner.pool, runner.backend)
    assert stack is not None
    runner.stack = stack
    return stack


def _step(runner: ModelRunner, alloc: SlotAllocator, work: list[tuple[Seq, int]],
          prefixes: list[RowPrefix] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of `n` new tokens per Seq -> (the model's hidden states, the stack's or None).
    The stack must store the step's K/V (codes and scales too) exactly as the model did."""
    batch = build_batch(alloc, work, prefixes)
    assert runner.stack is not None
    with torch.inference_mode():
        inputs = runner.prepare(batch)
        want = runner.model(inputs.input_ids, inputs.positions, inputs.attn_meta)
        stored = runner.pool.gather(batch.out_slots)  # raw bytes: codes and scales as well
        runner.pool.scatter(torch.zeros_like(stored), batch.out_slots)  # the stack rewrites them
        got = runner.stack.forward(inputs.input_ids, inputs.positions, inputs.attn_meta)
        if got is not None:
            assert torch.equal(runner.pool.gather(batch.out_slots), stored)
        else:
            runner.pool.scatter(stored, batch.out_slots)
    return want, got


def _greedy_step(runner: ModelRunner, alloc: SlotAllocator,
                 work: list[tuple[Seq, int]]) -> list[int] | None:
    """A step of decodes through ModelRunner.greedy_tokens (None where it declines)."""
    batch = build_batch(alloc, work)
    batch.sample_indices = list(range(batch.batch_size))  # every token samples
    return runner.greedy_tokens(runner.prepare(batch), runner.vocab_size)


def _check_steps(runner: ModelRunner) -> None:
    """Prefills, then decodes, a grouped decode over a shared prefix, and decodes mixed with
    short extends: the stack's output equals the model's. A bf16 stack whose projections all
    have the bf16 GEMM (quantized or plain, biased or not: Qwen2's q/k/v)
    takes long steps too (GEMM_MAX_TOKENS): there the prefills go through it, elsewhere they are
    too long for it."""
    largest = _every_extend_native(runner).max_tokens
    bf16 = runner.dtype == torch.bfloat16
    any_step = runner.activation_quant != "none"  # its kernels take steps of any size
    gemm = bf16 and (any_step or bf16_gemm_here())
    assert largest == (GEMM_MAX_TOKENS if gemm else SkinnyBf16Method.SKINNY_ROWS if bf16
                       else MAX_TOKENS)
    alloc = SlotAllocator(runner.num_slots)
    shared = random_ids(40, 1)
    seqs = [Seq(0, random_ids(30, 2) + random_ids(20, 12)), Seq(1, shared + random_ids(20, 3)),
            Seq(2, random_ids(7, 4) + random_ids(20, 14))]
    want, got = _step(runner, alloc, [(seqs[0], 30), (seqs[1], 40), (seqs[2], 7)])
    assert (got is None) == (77 > largest)  # 77 tokens: the model's path unless the GEMM's
    assert got is None or torch.equal(got, want)
    # a fourth request reusing the second one's 40 cached tokens (a prefix-cache hit)
    fourth = Seq(3, shared + random_ids(20, 5), slots=list(seqs[1].slots))
    prefix = [RowPrefix(3, list(fourth.slots))]
    want, got = _step(runner, alloc, [(fourth, 1)], prefix)
    assert got is not None and torch.equal(got, want)
    top = min(largest, 16)  # the largest step tried (seqs[2] has 27 tokens)
    for work in ([(s, 1) for s in (*seqs, fourth)],  # decodes: 1 and 3 grouped (40 shared)
                 [(seqs[0], 1), (seqs[1], 3), (seqs[2], 1), (fourth, 3)],  # mixed with extends
                 [(seqs[2], top)]):
        want, got = _step(runner, alloc, work)
        assert got is not None and torch.equal(got, want), work
    if gemm:  # decodes and extends, 11 tokens: past 8, so through the bf16 GEMM (or q8 kernels)
        want, got = _step(runner, alloc, [(seqs[0], 6), (seqs[1], 3), (fourth, 2)])
        assert got is not None and torch.equal(got, want)
    else:
        want, got = _step(runner, alloc, [(seqs[0], largest - 1), (seqs[1], 2)])
        assert got is None  # one token too many
    # extends past max_extend go to the prefill kernel, inside the stack too: a decode, a fresh
    # prompt and a 3-token extend over the shared prefix; in bf16 also with the prefill
    # kernel's products on tiles (emulated here; AMX's on AMX), where the per-op path has them
    fresh = 100 if largest >= 104 else 4  # a longer prompt where the stack takes one
    work = [(seqs[1], 1), (Seq(4, random_ids(fresh, 21)), fresh), (fourth, 3)]
    for tiles in [0, *(tile_modes_here() if bf16 else [])]:
        # (prefill_kernel: no start-up probe, which on AMX may send fresh chunks to SDPA)
        runner.backend = CpuNativeBackend(runner.pool, runner.table, max_extend=2,
                                          prefill_kernel=True, tiles=tiles)
        runner.stack = NativeLayerStack.build(runner.model, runner.pool, runner.backend)
        assert runner.stack is not None
        # the same step each time: the requests as they were, new slots for its tokens
        want, got = _step(runner, alloc, [(Seq(q.row, q.tokens, list(q.slots)), n)
                                          for q, n in work])
        assert got is not None and torch.equal(got, want), tiles
        assert runner.stack._step.pf_reqs == 2 and runner.stack._step.n_groups == 1
        assert runner.stack._step.pf_tiles == tiles  # (test_prefill_attention: that it is run)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_stack_equals_the_model(model_dirs: dict[str, Path], arch: str,
                                quantization: str) -> None:
    runner = make_runner(model_dirs[arch], dtype="float32", quantization=quantization,
                         linear_kernel="native" if quantization == "none" else "auto")
    _check_steps(runner)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "int4-q8"])
def test_bf16_stack_equals_the_bf16_model(model_dirs: dict[str, Path], arch: str,
                                          quantization: str) -> None:
    """In bf16 every op of both paths rounds where torch rounds: the same bf16 hidden states
    (quantized projections: their float32 kernels between a widened input and a rounded
    output, in both; with 8-bit activations, int4-q8, those kernels' bf16 entry at every step
    size, so batched decodes and long extends go through the stack too)."""
    if quantization == "none" and not SkinnyBf16Method.available(torch.device("cpu"),
                                                                 torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    quantization, _, q8 = quantization.partition("-")
    runner = make_runner(model_dirs[arch], dtype="bfloat16", quantization=quantization,
                         activation_quant="int8" if q8 else "none",
                         linear_kernel="native" if quantization == "none" else "auto")
    assert runner.pool.dtype == torch.bfloat16
    _check_steps(runner)


def test_rope_tables_grow_and_hold_the_embeddings_own_values(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack gathers each position's cos / sin from tables made by the model's rotary
    embedding; a step past their end grows them (then runs) and still equals the model."""
    monkeypatch.setattr(native_stack, "ROPE_ROWS", 8)
    monkeypatch.setattr(native_stack, "ROPE_BLOCK", 8)
    runner = make_runner(model_dirs["llama"], dtype="bfloat16")
    stack = _every_extend_native(runner)
    assert stack._struct.rope_rows == 8
    _check_steps(runner)  # positions up to 69 (the last steps on a stack built anew)
    assert runner.stack is not None and runner.stack._struct.rope_rows >= 40
    cos, sin = runner.stack._rope
    for p in (0, 7, 8, 33, 39):
        one = runner.model.rotary.forward(torch.tensor([p]), torch.bfloat16)
        assert torch.equal(one[0][0], cos[p]) and torch.equal(one[1][0], sin[p])


@pytest.mark.parametrize("arch,dtype,quantization,kv", [
    ("llama", "float32", "int8", "int8"), ("qwen3", "float32", "int8", "int8"),
    ("llama", "float32", "int4", "fp8_e4m3"), ("qwen2", "bfloat16", "none", "int8"),
    ("llama", "bfloat16", "int8", "fp8_e4m3"), ("qwen3", "bfloat16", "int4", "fp8_e5m2"),
    ("qwen2", "bfloat16", "none", "fp8"), ("llama", "float32", "none", "fp8")])
def test_stack_equals_the_model_over_a_quantized_pool(model_dirs: dict[str, Path], arch: str,
                                                      dtype: str, quantization: str,
                                                      kv: str) -> None:
    """The stack quantizes the new K/V rows itself: the same codes and scales as the pool's
    quantize_rows (a bf16 row widened first, as it is there), so the same hidden states (and
    the same pool) as the per-op path, and it attends the codes with the same kernels."""
    runner = make_runner(model_dirs[arch], dtype=dtype, quantization=quantization,
                         kv_cache_dtype=kv, **({"linear_kernel": "native"}
                                               if quantization == "none" else {}))
    assert runner.stack is not None and runner.pool.quantized
    _check_steps(runner)


@pytest.mark.parametrize("wtype,arch,dtype", [("Q8_0", "llama", "float32"),
                                              ("Q8_0", "llama", "bfloat16"),
                                              ("Q4_1", "qwen2", "float32"),
                                              ("Q4_K", "llama", "float32"),
                                              ("Q4_K", "qwen2", "bfloat16")])
def test_stack_equals_the_model_on_gguf_blocks(tmp_path: Path, tokenizer_dir: Path, wtype: str,
                                               arch: str, dtype: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from tests.gguf_helpers import write_gguf

    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir, arch, wtype, tied=True)
    runner = make_runner(resolve_model_dir(str(path), show_progress=False), dtype=dtype,
                         quantization="gguf", gguf_file=path)
    _check_steps(runner)


@pytest.mark.skipif(not bf16_gemm_here(), reason="no bf16 GEMM kernel on this CPU")
@pytest.mark.parametrize("kernel", ["auto", "native"])
def test_amx_dense_bf16_batched_steps(llama_dir: Path, kernel: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AMX (its flag faked here; the GEMM's tiles stay off: none are granted)
    `auto` and `--linear-kernel native` both give a dense bf16 model's projections and head the
    GEMM's pairs (oneDNN's GEMM on AMX tiles measured no faster at random 64 there, and the
    stack then runs batched steps and picks greedy tokens): equal to the model's."""
    monkeypatch.setattr(native, "amx_here", lambda: True)
    runner = make_runner(llama_dir, dtype="bfloat16", linear_kernel=kernel)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    paired = [hasattr(m, "pairs") for m in linears]
    assert all(paired)
    _check_steps(runner)


def test_stack_stands_aside_without_native_pieces(llama_dir: Path) -> None:
    assert make_runner(llama_dir, dtype="bfloat16", linear_kernel="torch").stack is None
    assert make_runner(llama_dir, dtype="float32", linear_kernel="torch").stack is None
    assert make_runner(llama_dir, dtype="float32", quantization="int8",
                       attention_backend="sdpa").stack is None
    runner = make_runner(llama_dir, dtype="float32", quantization="int8")
    assert runner.stack is not None
    alloc = SlotAllocator(runner.num_slots)
    seq = Seq(0, random_ids(9, 6))
    _step(runner, alloc, [(seq, 8)])
    dequantize_in_place(runner.model)  # projections changed under the stack: it must not run
    want, got = _step(runner, alloc, [(seq, 1)])
    assert got is None


def test_the_stack_times_its_ops_when_asked(model_dirs: dict[str, Path]) -> None:
    """A profile sees the stack as one call: asked, it adds up each kind of op's time itself
    (every kind but the head runs in a decode step's forward, the head in a greedy one, and
    together they fit in the steps' wall time)."""
    runner = make_runner(model_dirs["llama"], dtype="float32", linear_kernel="native")
    stack = _every_extend_native(runner)
    alloc = SlotAllocator(runner.num_slots)
    seqs = [Seq(0, random_ids(12, 1) + random_ids(4, 2)), Seq(1, random_ids(9, 3))]
    _step(runner, alloc, [(seqs[0], 6), (seqs[1], 5)])
    assert stack.op_seconds() == {}
    stack.time_ops()
    assert set(stack.op_seconds()) == set(STACK_OPS) and not any(stack.op_seconds().values())
    t0 = time.perf_counter()
    _, got = _step(runner, alloc, [(seqs[0], 1), (seqs[1], 1)])
    wall = time.perf_counter() - t0
    seconds = stack.op_seconds()
    assert got is not None and seconds.pop("head") == 0, seconds
    assert all(v > 0 for v in seconds.values()), seconds
    assert sum(seconds.values()) < wall
    t0 = time.perf_counter()
    tokens = _greedy_step(runner, alloc, [(seqs[0], 1), (seqs[1], 1)])
    wall += time.perf_counter() - t0
    seconds = stack.op_seconds()
    assert tokens is not None and seconds["head"] > 0 and sum(seconds.values()) < wall
    stack.time_ops(False)
    _step(runner, alloc, [(seqs[0], 1), (seqs[1], 1)])
    assert stack.op_seconds() == {} and not stack._step.op_seconds


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("bfloat16", "none"),
                                                ("bfloat16", "int8"), ("bfloat16", "int4")])
def test_greedy_tokens_are_the_samplers_argmax(model_dirs: dict[str, Path], arch: str,
                                               dtype: str, quantization: str) -> None:
    """The stack's greedy step (LM head and argmax in its one call) picks, for one decode, a
    batch of them and speculative checks, the tokens the sampler's argmax takes from
    compute()'s logits."""
    if dtype == "bfloat16" and quantization == "none" and not SkinnyBf16Method.available(
            torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bf16 packing in this torch")
    runner = make_runner(model_dirs[arch], dtype=dtype, quantization=quantization,
                         linear_kernel="native" if quantization == "none" else "auto")
    _every_extend_native(runner)
    alloc = SlotAllocator(runner.num_slots)
    seqs = [Seq(i, random_ids(40, 30 + i)) for i in range(4)]
    for seq in seqs:
        _step(runner, alloc, [(seq, 30)])
    for work in ([(seqs[0], 1)], [(s, 1) for s in seqs], [(seqs[2], 1), (seqs[3], 1)]):
        batch = build_batch(alloc, work)
        batch.sample_indices = list(range(batch.batch_size))
        with torch.inference_mode():
            inputs = runner.prepare(batch)
            want = argmax_rows(runner.compute(inputs)[0][:, : runner.vocab_size]).tolist()
        assert runner.greedy_tokens(inputs, runner.vocab_size) == want, work
    # speculative checks: each request's k guesses and the token before them, every logit row
    batch = build_batch(alloc, [(seqs[0], 4), (seqs[1], 1), (seqs[3], 3)])
    batch.sample_indices = [0, 1, 2]
    batch.proposed = [seqs[0].tokens[-3:], [], seqs[3].tokens[-2:]]
    with torch.inference_mode():
        inputs = runner.prepare(batch)
        assert inputs.every_token
        want = argmax_rows(runner.compute(inputs)[0][:, : runner.vocab_size]).tolist()
    assert len(want) == 8 and runner.greedy_tokens(inputs, runner.vocab_size) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_is_numpys(dtype: torch.dtype) -> None:
    """The stack's argmax over each row's first n values (a row stride past them) is numpy's
    over the float32 values: the first of equal maxima (0 and -0 alike), the first NaN."""
    lib = native.load()
    fn = getattr(lib, "banyan_argmax_rows_" + ("bf16" if dtype == torch.bfloat16 else "f32"))
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64]
    torch.manual_seed(0)
    for n, stride in ((1, 1), (15, 16), (16, 20), (77, 80), (1000, 1003)):
        x = torch.randn(9, stride).to(dtype)
        x[1, n // 2] = x[1, n - 1] = 100.0  # a tie: the first
        x[2, :n] = -float("inf")
        x[3, :n] = 0.0
        x[3, n - 1] = -0.0
        x[4, :n] = -0.0
        x[4, n - 1] = 0.0
        x[5, n - 1] = float("nan")
        x[6, n // 3] = float("nan")
        x[6, n - 1] = float("inf")
        x[7, n - 1] = float("inf")
        x[8, n - 1] = 1e30  # (bf16: beyond every random value too)
        out = torch.full((9,), -1, dtype=torch.int64)
        for threads in (1, 2):
            fn(x.data_ptr(), 9, n, stride, out.data_ptr(), threads)
            assert out.tolist() == np.argmax(x[:, :n].float().numpy(), axis=1).tolist(), n
