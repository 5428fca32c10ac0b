"""The scheduler's Runner: `launch(batch)` prepares a step and starts it; `handle.result()` is its
StepOutput (tokens per sampling request, proposals checked).

Preparation (tensors from the batch's lists, the table, the attention plan) runs on the calling
thread; the forward, the sampler and the check of proposed tokens run in launch order on one
worker thread when overlapping (torch ops and the ctypes kernels release the GIL, so the engine
schedules the next step meanwhile), or inline when not. Steps touch device state (KV pool, token
buffer) only on that worker, in order; a later step's table writes only reach positions an
earlier step does not read (its requests' new tokens, or rows of requests that have ended, whose
release waits for the step reading them).

The per-row token buffer holds the last token sampled for each table row, so a step built before
its predecessor finished can name "row r's next input is what the step before samples".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from banyan.batch import ForwardBatch, SamplingRow, StepOutput, TokenLogprobs
from banyan.host_tensors import int64_tensor, to_device
from banyan.runner.model_runner import ModelRunner, StepInputs
from banyan.runner.threads import ThreadGovernor
from banyan.sampling.sampler import Sampler
from banyan.structured.masks import advance_grammars, fill_token_masks


class DoneStep:
    """The handle of a step already computed (or failed)."""

    def __init__(self, output: StepOutput | None, error: BaseException | None = None) -> None:
        self._output, self._error = output, error

    def result(self) -> StepOutput:
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output


class DeferredStep:
    """The handle of a step computed inline when collected (no overlap): the engine's time
    inside result() is then the forward, as with a worker it is the wait for it."""

    def __init__(self, compute: Callable[[], StepOutput]) -> None:
        self._compute = compute

    def result(self) -> StepOutput:
        return self._compute()


class RunningStep:
    """The handle of a step on the worker thread."""

    def __init__(self, future: Future[StepOutput]) -> None:
        self._future = future

    def result(self) -> StepOutput:
        return self._future.result()


class ModelStepRunner:
    def __init__(self, model_runner: ModelRunner, sampler: Sampler, overlap: bool = False,
                 governor: ThreadGovernor | None = None) -> None:
        self.model_runner = model_runner
        self.sampler = sampler
        self.governor = governor  # None: the thread count stays as it is
        rows = model_runner.max_rows
        self._row_tokens = torch.zeros(rows, dtype=torch.int64, device=model_runner.device)
        self._row_last: list[int] = [0] * rows  # host copy, for penalties over a pending token
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="banyan-step")
                        if overlap else None)

    def launch(self, batch: ForwardBatch) -> DoneStep | DeferredStep | RunningStep:
        t0 = time.perf_counter()
        try:
            inputs = self.model_runner.prepare(batch)
        except Exception as exc:  # noqa: BLE001 - reported by result(), as a forward error is
            return DoneStep(None, exc)
        prepare = time.perf_counter() - t0
        if self._worker is not None:
            return RunningStep(self._worker.submit(self._execute, batch, inputs, prepare))
        return DeferredStep(lambda: self._execute(batch, inputs, prepare))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _execute(self, batch: ForwardBatch, inputs: StepInputs, prepare: float) -> StepOutput:
        if self.governor is None:
            return self._compute_step(batch, inputs, prepare)
        with self.governor.applied():  # here: on the thread that computes
            return self._compute_step(batch, inputs, prepare)

    def _compute_step(self, batch: ForwardBatch, inputs: StepInputs,
                      prepare: float) -> StepOutput:
        t0 = time.perf_counter()
        for part in inputs.parts():
            if part.deferred is not None:
                d = part.deferred
                part.input_ids.index_copy_(0, d.flat, self._row_tokens.index_select(0, d.rows))
        rows = self._logit_rows(batch)
        masks = fill_token_masks(batch.sampling, batch.proposed, self.sampler.vocab_size)
        greedy = None  # plain greedy rows: their tokens from the forward's own native call
        burst = None  # a burst's tokens (ForwardBatch.decode_steps), the same way
        if masks is None and all(r.plain for r in rows):
            vocab = self.sampler.vocab_size
            burst = self.model_runner.greedy_burst(inputs, vocab)
            if burst is None:  # (a burst then runs its first decode step only)
                greedy = self.model_runner.greedy_tokens(inputs, vocab)
        prompt_logprobs: list[list[TokenLogprobs]] = []
        if burst is not None:
            t1 = time.perf_counter()
            tokens, logprobs = burst, []
        elif greedy is not None:
            t1 = time.perf_counter()
            tokens, logprobs = self._accept(batch, greedy, [None] * len(greedy))
        else:
            logits, prompt_logprobs = self.model_runner.compute(inputs)
            t1 = time.perf_counter()
            result = self.sampler.sample(logits, rows, token_masks=masks)
            tokens, logprobs = self._accept(batch, result.next_tokens, result.logprobs)
        if masks is not None:  # here, on the worker, so matchers see tokens in step order
            advance_grammars(batch.sampling, tokens)
        if tokens and self._worker is not None:  # only overlap reads the buffer back
            last = [t[-1] for t in tokens]
            rows_now = [r.row for r in batch.sampling]
            if min(rows_now) >= 0:
                dev = self._row_tokens.device
                self._row_tokens.index_copy_(0, to_device(int64_tensor(rows_now), dev),
                                             to_device(int64_tensor(last), dev))
                for r, t in zip(rows_now, last, strict=True):
                    self._row_last[r] = t
        t2 = time.perf_counter()
        return StepOutput(tokens, logprobs, prompt_logprobs,
                          {"prepare": prepare, "forward": t1 - t0, "sample": t2 - t1})

    def _logit_rows(self, batch: ForwardBatch) -> list[SamplingRow]:
        """One sampler row per logit row: a request with k proposals samples at k + 1
        positions, the j-th as if the first j proposals were already its output."""
        if not batch.proposed and self._worker is None:
            return batch.sampling  # nothing pending, nothing proposed: the rows as built
        rows: list[SamplingRow] = []
        proposed = batch.proposed or [[] for _ in batch.sampling]
        for row, guess in zip(batch.sampling, proposed, strict=True):
            history = row.output_ids
            if row.pending and row.params.reads_output_ids:
                history = history + [self._row_last[row.row]]
            if not guess:
                rows.append(row if history is row.output_ids
                            else dataclasses.replace(row, output_ids=history, pending=0))
                continue
            for j in range(len(guess) + 1):
                seen = history + guess[:j] if row.params.reads_output_ids else history
                rows.append(dataclasses.replace(row, output_ids=seen,
                                                num_output=row.generated + j, pending=0))
        return rows

    @staticmethod
    def _accept(batch: ForwardBatch, sampled: list[int],
                logprobs: list[TokenLogprobs | None]) -> tuple[list[list[int]],
                                                               list[list[TokenLogprobs]]]:
        """Per sampling request, its tokens: each proposal the model itself sampled is
        accepted, then the model's token at the first mismatch (or after the last proposal).
        Sampling at each position and comparing is exact for proposals that are single
        guesses (the output follows the model's own distribution, greedy or not)."""
        if not any(batch.proposed):  # one token per request: nothing to check
            if logprobs.count(None) == len(logprobs):  # none asked (StepOutput: may be empty)
                return [[t] for t in sampled], []
            return ([[t] for t in sampled],
                    [[] if lp is None else [lp] for lp in logprobs])
        tokens: list[list[int]] = []
        lps: list[list[TokenLogprobs]] = []
        at = 0
        proposed = batch.proposed
        for guess in proposed:
            n = 0
            while n < len(guess) and sampled[at + n] == guess[n]:
                n += 1
            tokens.append(sampled[at : at + n + 1])
            lps.append([lp for lp in logprobs[at : at + n + 1] if lp is not None])
            at += len(guess) + 1
        return tokens, lps
