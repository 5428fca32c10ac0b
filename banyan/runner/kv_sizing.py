"""KV cache sizing by a warm-up step: `--mem-fraction` of the memory the largest step leaves.

Sizing the pool as a fraction of the memory free after the weights load ignores the activations
of the steps to come, so on a GPU a large prefill step can run out of memory after the pool took
its share. Instead (vLLM's and SGLang's profile run), the runner first computes the largest step
the scheduler can send (`warmup_batch`) over a temporary pool just big enough for it, records
the allocator's peak above what was allocated before the step (`measure_peak`), frees the
temporary pool, and gives the KV cache `mem_fraction` of what is free then minus that peak
(`kv_budget`).

The memory reads sit behind `MemoryProbe`, so the arithmetic and the order of the reads are
tested on CPU with a fake probe; `CudaMemoryProbe` is the caching allocator's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from banyan.batch import ForwardBatch
from banyan.runner.device import available_memory

logger = logging.getLogger(__name__)
MIB = 2**20


class MemoryProbe(Protocol):
    """The device memory reads the warm-up sizing needs."""

    def free_bytes(self) -> int:
        """Bytes free on the device now (other processes' use excluded)."""
        ...

    def allocated_bytes(self) -> int:
        """Bytes this process's tensors hold on the device now."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak: `peak_bytes` reports the most allocated from here on."""
        ...

    def peak_bytes(self) -> int:
        """The most bytes allocated at once since `reset_peak`."""
        ...

    def release_cached(self) -> None:
        """Give the allocator's cached free blocks back, so `free_bytes` counts them."""
        ...


@dataclass(frozen=True, slots=True)
class CudaMemoryProbe:
    """MemoryProbe of a CUDA device: torch's caching allocator statistics."""

    device: torch.device

    def free_bytes(self) -> int:
        return available_memory(self.device)

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)  # the step's kernels done before its blocks go back
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class KVSizing:
    """The figures of one warm-up sizing (bytes), logged and kept on the runner."""

    resident: int  # allocated before the warm-up: weights and the request-to-token table
    warmup_tokens: int  # tokens of the warm-up step
    activation_peak: int  # the step's peak above what was allocated before it
    free_after: int  # free on the device once the temporary pool was released
    mem_fraction: float
    budget: int  # bytes for the KV cache


def warmup_batch(prefill_tokens: int, chunk: int, max_rows: int, max_context: int,
                 vocab: int) -> ForwardBatch:
    """The largest step the scheduler can build: `prefill_tokens` prompt tokens in chunks of
    at most `chunk` per request (one table row each), and a decode in every other row
    (decodes ride on top of the prefill budget); every request samples. Out slots 1..T (slot
    0 is the padding slot), so a pool of T + 1 slots holds it."""
    if prefill_tokens < 1 or chunk < 1:
        raise ValueError(f"warm-up needs prefill_tokens >= 1 and chunk >= 1, got "
                         f"{prefill_tokens}, {chunk}")
    chunk = min(chunk, max_context)  # no request runs longer than a table row
    lens: list[int] = []
    left = prefill_tokens
    while left > 0 and len(lens) < max_rows:  # each chunk needs its own row
        lens.append(min(chunk, left))
        left -= lens[-1]
    lens += [1] * (max_rows - len(lens))
    total = sum(lens)
    return ForwardBatch(
        rows=list(range(len(lens))), prefix_lens=[0] * len(lens), extend_lens=lens,
        # token ids spread over the vocabulary: the step's cost should not hinge on one row
        input_ids=[(7919 * i) % vocab for i in range(total)],
        out_slots=list(range(1, total + 1)), sample_indices=list(range(len(lens))),
        max_shared_prefix=0,
    )


def measure_peak(probe: MemoryProbe, step: Callable[[], object]) -> int:
    """Bytes `step` allocated at its peak above what was allocated before it (>= 0). The
    step's result is dropped before returning, so its buffers are free again."""
    base = probe.allocated_bytes()
    probe.reset_peak()
    step()
    return max(0, probe.peak_bytes() - base)


def kv_budget(free: int, activation_peak: int, mem_fraction: float) -> int:
    """KV bytes: mem_fraction of what is free once the largest step's activations are set
    aside. ValueError, naming the sizes and the options, when they leave nothing."""
    left = free - activation_peak
    if left <= 0:
        raise ValueError(
            f"KV cache: the warm-up step's activations peak at {activation_peak / MIB:.1f} MiB, "
            f"more than the {free / MIB:.1f} MiB free after the weights: nothing is left for "
            "--mem-fraction to give the KV cache; lower --max-prefill-tokens / "
            "--chunked-prefill-size or --max-running-requests, or use a smaller model")
    return int(left * mem_fraction)


def size_by_warmup(probe: MemoryProbe, mem_fraction: float, warmup_tokens: int,
                   run_warmup: Callable[[], int]) -> KVSizing:
    """Run the warm-up (`run_warmup`: builds its temporary pool, measures the step with
    `measure_peak`, drops the pool, returns the peak), then size the KV budget from what is
    free after it."""
    resident = probe.allocated_bytes()
    peak = run_warmup()
    probe.release_cached()  # the temporary pool's and the step's blocks count as free again
    free = probe.free_bytes()
    sizing = KVSizing(resident, warmup_tokens, peak, free, mem_fraction,
                      kv_budget(free, peak, mem_fraction))
    logger.info(
        "KV sizing: weights and table %.1f MiB; warm-up step of %d tokens peaked %.1f MiB above "
        "them; %.1f MiB free after it; KV budget %.2f x (free - peak) = %.1f MiB",
        resident / MIB, warmup_tokens, peak / MIB, free / MIB, mem_fraction, sizing.budget / MIB)
    return sizing
