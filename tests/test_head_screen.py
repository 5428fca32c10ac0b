"""The LM head's screen (kernels/cpu_head_screen.cpp, models/head_screen.py): a one-token greedy
step of a bf16 model reads the head's int8 copy, recomputes only the rows its bound cannot rule
out, and must take the whole head's token in every case: exact ties (the first row wins), near
ties that bf16 rounding may or may not make ties, large and small inputs; a NaN input falls back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.kernels import native
from banyan.layers.panels import pack_bf16_pairs
from banyan.models import head_screen
from banyan.server.ipc import EngineStats
from banyan.server.metrics import ServerMetrics

pytestmark = pytest.mark.skipif(native.load() is None, reason="native CPU kernels unavailable")


def _screen_fn() -> ctypes._CFuncPtr:
    fn = native.load().banyan_head_screen_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int64
    return fn


def _screened(w: torch.Tensor, x: torch.Tensor, vocab: int) -> tuple[int, int]:
    """(the screen's token, the whole head's: numpy's argmax of its bf16 logits)."""
    pairs = pack_bf16_pairs(w)
    screen = head_screen.make_head_screen(w)
    assert screen is not None
    got = _screen_fn()(x.data_ptr(), w.shape[1], pairs.data_ptr(), native.PAIRS_BF16_KIND,
                       screen.codes.data_ptr(), screen.scale.data_ptr(), head_screen.GROUP,
                       screen.slack.data_ptr(), w.shape[0], vocab, 2)
    logits = native.bf16_pairs_gemm(x[None], pairs, w.shape[0])[0, :vocab]
    return got, int(np.argmax(logits.float().numpy()))


def test_the_screen_takes_the_whole_heads_token() -> None:
    torch.manual_seed(11)
    n, k = 300, 96
    base = torch.randn(n, k).bfloat16()
    fallbacks = 0
    for trial in range(120):
        w = base.clone()
        x = (torch.randn(k) * (0.01, 1.0, 40.0)[trial % 3]).bfloat16()
        top = int(np.argmax((x.float() @ w.float().T).numpy()))
        other = (top + 1 + 37 * trial) % n
        if trial % 4 == 1:  # an exact tie: the first of the two rows
            w[other] = w[top]
        elif trial % 4 == 2:  # a near tie: one input nudged by a bf16 ulp or so
            w[other] = w[top]
            i = trial % k
            w[other, i] = (w[top, i].float() * (1 + 2.0 ** -7)).bfloat16()
        elif trial % 4 == 3:  # a near tie within the same 16-row panel and across panels
            w[top ^ 1] = w[top]
            w[other] = (w[top].float() * (1 - 2.0 ** -9)).bfloat16()
        else:  # 6 close rivals of the top row, their copies coarse (an outlier sets each
            x[::32] = 0.0  # group's scale; the input does not see it)
            w[top, ::32] = 40.0
            rivals = torch.randperm(n)[:6]
            w[rivals] = (w[top].float() + 0.05 * torch.randn(6, k)).bfloat16()
            w[rivals, ::32] = 40.0
        got, want = _screened(w, x, n - trial % 5)
        if got == -1:  # too many candidate panels: the caller computes the whole head
            assert trial % 4 == 0, trial  # (only where the copies were made coarse)
            fallbacks += 1
        else:
            assert got == want, trial
    assert fallbacks < 10  # of 30 coarse trials: the screen still decides most


def test_the_screen_falls_back_on_a_nan_input() -> None:
    w = torch.randn(64, 64).bfloat16()
    x = torch.randn(64).bfloat16()
    x[3] = float("nan")
    got, _ = _screened(w, x, 64)
    assert got == -1


def test_a_bf16_model_takes_the_same_tokens_with_the_screen(llama_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Greedy requests one at a time (one-token steps: the screen's) give the tokens of an
    engine without it, and the screen ran without falling back."""
    prompts = [[5 + i, 17, 90 + 3 * i, 33] for i in range(4)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(head_screen.SWITCH, switch)
        engine = Engine(str(llama_dir), dtype="bfloat16", device="cpu", disable_tqdm=True,
                        kv_cache_memory="64MiB")
        try:
            stack = engine.core.scheduler.runner.model_runner.stack
            if stack is None:
                pytest.skip("no native layer stack here")
            outputs.append([engine.generate(sampling_params=params, input_ids=[p],
                                            use_tqdm=False)[0].output_ids for p in prompts])
            counts = engine.core.stats().head_screen
            if switch == "1":
                if counts is None:
                    pytest.skip("no screen for this head (no bf16 pairs here)")
                assert counts[0] >= len(prompts) * 20 and counts[1] == 0
            else:
                assert counts is None
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def test_the_screens_counts_are_metrics() -> None:
    metrics = ServerMetrics("tiny")
    text = metrics.render().decode()
    assert "banyan:head_screen_steps" not in text  # no screen: no series
    metrics.engine = EngineStats(head_screen=[41, 2])
    text = metrics.render().decode()
    assert 'banyan:head_screen_steps_total{model_name="tiny"} 41.0' in text
    assert 'banyan:head_screen_fallbacks_total{model_name="tiny"} 2.0' in text
