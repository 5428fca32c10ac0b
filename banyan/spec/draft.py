"""Draft-model proposals: a smaller model with the target's tokenizer guesses greedily.

The draft runs on Banyan's own ModelRunner with a paged KV pool and table of its own. Each
request it has seen keeps a row and the tokens whose K/V the draft holds; before guessing, that
list is cut back to what the request's real tokens still agree with (the guesses the target
rejected are rolled back, their slots freed) and the draft catches up on the rest (the prompt on
first sight, then the target's own token and any accepted guess it never fed). Then one batched
forward per guessed position, all requests together.

Guesses are the draft's argmax: a proposal that is one fixed token per position makes the
target's sample-and-compare check (runner/step.py) exactly the rejection sampling of
speculative decoding, so outputs follow the target's distribution at any temperature.
A request's guessing stops after a guess the draft gives less than `min_confidence` of its
probability (transformers' assisted generation stops the same way): such a guess is still
checked, but the ones after it would seldom be accepted, and each costs a draft forward (chat on
SmolLM2-135M with its int4 copy as the draft, Zen 4: 1.44x at 0.2 against 1.33x at 0 in one
run, a small gain inside the machine's spread; docs/performance.md).
Where it reads fewer bytes, the guesses come from a 4-bit copy of the draft's LM head, the few
logits near the largest recomputed exactly (draft_head.py).
With a `lookup` (an NgramProposer), a request whose recent tokens appeared earlier in its own
text takes the continuation found there (at least LOOKUP_MIN tokens) and no draft forward
this step: where the text repeats, prompt lookup guesses nearly as well as the draft at no
cost (SmolLM2-135M, Zen 4, side by side: chat 1.35x -> 1.51x, grounded 1.44x -> 2.41x of
speculation off; docs/performance.md); the draft catches up on those tokens at its next guess.
Where the layer stack runs the draft and its head is picked from the 4-bit copy, the positions
after the first go as one burst of decode steps (ForwardBatch.decode_steps), the picks made
between them in Python: the batch, tensors, table and plan of a position are made once a burst
(the draft's host time a position ~0.07 ms less of ~2.4 ms, chat on SmolLM2-135M, Zen 5).
The draft keeps no prefix cache: a prompt it has not seen is computed in full (draft prefill is a
small fraction of a target prefill, and only the first decode step of a request pays it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from banyan.batch import ForwardBatch
from banyan.sampling.greedy import top_token_and_probability
from banyan.mem.allocator import SlotAllocator
from banyan.runner.model_runner import ModelRunner
from banyan.scheduler.request import Request
from banyan.scheduler.speculation import StepCost
from banyan.spec.draft_head import DraftHead
from banyan.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)

LOOKUP_MIN = 2  # tokens a lookup must find to stand in for the draft (one is mostly a repeat)


@dataclass(slots=True)
class _DraftSeq:
    row: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V the draft holds
    slots: list[int] = field(default_factory=list)  # slots[i] holds tokens[i]'s K/V
    confirmed: int = 0  # tokens[:confirmed] are the request's own (the rest: fed guesses)


class DraftProposer:
    def __init__(self, runner: ModelRunner, target_vocab: int, min_confidence: float = 0.0,
                 lookup: NgramProposer | None = None) -> None:
        if runner.vocab_size < target_vocab:
            logger.warning("draft vocabulary (%d) is smaller than the target's (%d): guesses "
                           "only ever use the shared ids", runner.vocab_size, target_vocab)
        self.runner = runner
        self.head = DraftHead.build(runner.model, runner.device, runner.dtype)  # or None
        self.target_vocab = target_vocab
        self.min_confidence = min_confidence
        self.lookup = lookup
        self.lookup_min = LOOKUP_MIN
        self.looked_up = 0  # requests given a lookup's continuation instead of draft guesses
        self.allocator = SlotAllocator(runner.num_slots)
        self._free_rows = list(range(runner.max_rows - 1, -1, -1))
        self._seqs: dict[str, _DraftSeq] = {}
        self.cost = StepCost()  # seconds of a forward of one token per sequence, by sequences
        # Guess positions after the first as bursts of decode steps (where the layer stack runs
        # the draft and its head is picked from the 4-bit copy)
        self.bursts = runner.stack is not None and self.head is not None

    def propose(self, reqs: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in reqs]
        limit = list(max_tokens)
        seqs: dict[int, _DraftSeq] = {}
        feeds: dict[int, list[int]] = {}
        for i, req in enumerate(reqs):
            if self.lookup is not None:
                found = self.lookup.lookup(req.prompt_ids, req.output_ids, limit[i])
                if len(found) >= self.lookup_min:  # the text repeats: its continuation, no forward
                    guesses[i] = found
                    self.looked_up += 1
                    continue
            seq = self._catch_up_plan(req)
            if seq is None:
                continue
            seqs[i] = seq
            feeds[i] = req.token_ids(len(seq.tokens), req.num_tokens)
        with torch.inference_mode():
            pos = 0
            while True:
                live = [i for i in seqs if limit[i] > pos and
                        (pos == 0 or (guesses[i] and len(guesses[i]) == pos))]
                if not live:
                    break
                if pos > 0 and self.bursts:
                    ran = self._burst([seqs[i] for i in live], live, guesses, limit, pos)
                    if ran == 0:  # draft KV full: no guesses this step
                        return [[] for _ in reqs]
                    if ran is not None:
                        pos += ran
                        continue
                inputs = [feeds[i] if pos == 0 else [guesses[i][-1]] for i in live]
                found = self._forward([seqs[i] for i in live], inputs)
                if found is None:  # draft KV full: no guesses this step
                    return [[] for _ in reqs]
                if pos == 0:
                    for i in live:
                        seqs[i].confirmed = len(seqs[i].tokens)
                self._take(live, *found, guesses, limit, pos)
                pos += 1
        return guesses

    def _take(self, live: list[int], tokens: list[int], confidence: list[float],
              guesses: list[list[int]], limit: list[int], pos: int) -> bool:
        """The draft's picks at guess position `pos` for requests `live`: each a guess unless
        out of the target's vocabulary (its guessing ends), the last one where the draft is
        less sure than min_confidence. -> whether every one of them guesses on."""
        on = True
        for i, t, p in zip(live, tokens, confidence, strict=True):
            if t < self.target_vocab:
                guesses[i].append(t)
            else:
                on = False
            if p < self.min_confidence:  # guessed, but the draft guesses no further
                limit[i] = pos + 1
                on = False
        return on

    def seconds_per_position(self, requests: int) -> float:
        """A guessing forward for `requests` sequences at its measured cost (0.0 before any)."""
        return self.cost.at(requests) or 0.0

    def forget(self, req: Request) -> None:
        seq = self._seqs.pop(req.rid, None)
        if seq is not None:
            self.allocator.free(seq.slots)
            self._free_rows.append(seq.row)

    # ------------------------------------------------------------------

    def _catch_up_plan(self, req: Request) -> _DraftSeq | None:
        """req's draft sequence, cut back to the tokens req really has (at least one left to
        feed, whose logits give the first guess); None when no table row is free."""
        seq = self._seqs.get(req.rid)
        if seq is None:
            if not self._free_rows:
                return None
            seq = self._seqs[req.rid] = _DraftSeq(self._free_rows.pop())
        keep = seq.confirmed  # a request's tokens never change, only grow: check the guesses only
        real = req.token_ids(keep, min(len(seq.tokens), req.num_tokens - 1))
        for token in real:
            if seq.tokens[keep] != token:
                break
            keep += 1
        seq.confirmed = keep
        if keep < len(seq.tokens):
            self.allocator.free(seq.slots[keep:])
            del seq.tokens[keep:], seq.slots[keep:]
        return seq

    def _forward(self, seqs: list[_DraftSeq], inputs: list[list[int]]
                 ) -> tuple[list[int], list[float]] | None:
        """Extend each sequence by its inputs; the draft's argmax after each one's last input
        and the probability the draft gives it."""
        batch = ForwardBatch()
        need = sum(len(x) for x in inputs)
        slots = self.allocator.alloc(need)
        if slots is None:
            self._drop_all()
            return None
        at = 0
        for seq, new in zip(seqs, inputs, strict=True):
            taken = slots[at : at + len(new)]
            at += len(new)
            batch.rows.append(seq.row)
            batch.prefix_lens.append(len(seq.tokens))
            batch.extend_lens.append(len(new))
            batch.input_ids.extend(new)
            batch.out_slots.extend(taken)
            batch.sample_indices.append(len(batch.rows) - 1)
            seq.tokens.extend(new)
            seq.slots.extend(taken)
        start = time.perf_counter()
        if self.head is None:
            found = top_token_and_probability(self.runner.forward(batch))
        else:  # the guesses from the hidden states, through half the head's bytes
            hidden, _ = self.runner.compute_hidden(self.runner.prepare(batch))
            assert hidden is not None, "every sequence samples"
            found = self.head.pick(hidden)
        if need == len(seqs):  # a guessing position (a prompt's catch-up is priced by no one)
            self.cost.observe(need, time.perf_counter() - start)
        return found

    def _burst(self, seqs: list[_DraftSeq], live: list[int], guesses: list[list[int]],
               limit: list[int], pos: int) -> int | None:
        """Guess positions pos.. for `live` (each feeding its last guess) as one burst of the
        draft's decode steps (ForwardBatch.decode_steps), the picks made between them, until one
        of them stops guessing or reaches its limit: a guessing step's host work (its batch,
        tensors, table, plan) is done once, not once a position. -> the positions guessed; 0
        when the draft's KV is full (every sequence dropped); None where the layer stack does
        not run the steps (the slots taken are handed back)."""
        steps, n = min(limit[i] for i in live) - pos, len(seqs)
        slots = self.allocator.alloc(steps * n)
        if slots is None:
            self._drop_all()
            return 0
        batch = ForwardBatch(rows=[seq.row for seq in seqs],
                             prefix_lens=[len(seq.tokens) for seq in seqs],
                             extend_lens=[1] * n, input_ids=[guesses[i][-1] for i in live],
                             out_slots=slots[:n], sample_indices=list(range(n)),
                             decode_steps=steps, later_slots=slots[n:])
        start = time.perf_counter()

        def after(step: int, picks: np.ndarray, hidden: torch.Tensor) -> bool:
            assert self.head is not None
            tokens, confidence = self.head.pick(hidden)
            picks[:] = tokens  # the next step's inputs (a guess out of vocabulary stops it)
            return self._take(live, tokens, confidence, guesses, limit, pos + step)

        ran = self.runner.hidden_burst(self.runner.prepare(batch), after)
        if ran is None:
            self.allocator.free(slots)
            return None
        self.cost.observe(n, (time.perf_counter() - start) / ran)
        for k, (seq, i) in enumerate(zip(seqs, live, strict=True)):
            # fed: the guess before the burst, then each step's guess but the last
            seq.tokens += guesses[i][pos - 1 : pos - 1 + ran]
            seq.slots += slots[k :: n][:ran]
        self.allocator.free([s for j in range(ran, steps) for s in slots[j * n : (j + 1) * n]])
        return ran

    def _drop_all(self) -> None:
        """Out of draft KV (more live requests than its pool holds): start over; every
        sequence is recomputed at its next guess."""
        logger.warning("draft KV pool full: dropping the draft's sequences")
        for seq in self._seqs.values():
            self.allocator.free(seq.slots)
            self._free_rows.append(seq.row)
        self._seqs.clear()

