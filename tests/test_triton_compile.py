"""The Triton attention kernels compiled for a Hopper GPU (sm_90) here, without one: Triton's
compiler and ptxas run on the host, so what the interpreter never sees (tl.dot's shape and dtype
rules, shared memory, register allocation) is checked by every developer and CI. The tile
parameters are the ones the launchers use (decode_tile, extend_blocks, head_block).

Shapes (tests/triton_hopper.py): head_dim 64 (SmolLM2) and 128 (Llama 3 8B), GQA groups 3 and
4, bf16 and float32 pools (float32 with IEEE products), one and 16 decode splits in the merge.
Quantized pools (int8, fp8 e4m3 / e5m2 codes, bf16 queries) at SmolLM2's shape; the weight-only
int8 / int4 linear (kernels/triton_quant_linear.py) at 16- and 64-row blocks, bf16 and float32.
The fused element-wise kernels (kernels/triton_fused.py) too, at hidden sizes 576 and 2048.
The compiler runs in a process of its own, without the interpreter the other Triton tests set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import triton_hopper

SHARED_MEMORY = 227 * 1024  # an H100/H200 block's opt-in shared memory
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.triton_hopper"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


def test_every_variant_compiles_for_hopper(compiled: dict[str, dict[str, object]]) -> None:
    dtypes = len(triton_hopper.TYPES)
    attention = (dtypes * len(triton_hopper.SHAPES) + len(triton_hopper.QUANTIZED)) * 2 \
        + len(triton_hopper.SPLITS)
    quant_linear = dtypes * 2 * 2  # int8 / int4 x two row blocks
    fused = dtypes * (len(triton_hopper.WIDTHS) + 3)  # norms, SiLU-and-mul, RoPE x 2
    assert len(compiled) == attention + quant_linear + fused


def test_shared_memory_fits_a_hopper_block(compiled: dict[str, dict[str, object]]) -> None:
    for case, row in compiled.items():
        assert 0 <= int(row["shared"]) <= SHARED_MEMORY, case
        if case.startswith(("decode", "extend")):  # K/V tiles staged in shared memory
            assert int(row["shared"]) > 0, case


def test_bf16_products_run_on_tensor_cores(compiled: dict[str, dict[str, object]]) -> None:
    for case, row in compiled.items():
        attention = case.startswith(("decode", "extend"))
        codes = attention and any(f"-{name}-" in case for name in triton_hopper.QUANTIZED.values())
        if ("bf16" in case or codes) and (attention or case.startswith("quant-linear")):
            assert row["mma"], case  # (a quantized pool's codes go to its bf16 queries' dtype)
