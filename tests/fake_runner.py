"""A model-free Runner for scheduler tests.

It keeps its own request-to-token table and a "KV store" mapping each slot to the (token,
position) written there, and its next token is a hash of the context it reads back through the
table. So a scheduler bug that reads a wrong or overwritten slot, a stale row, or a wrong position
changes the output, exactly as it would with a real model.
"""

from __future__ import annotations

from banyan.batch import ForwardBatch, StepOutput
from banyan.runner.step import DoneStep

VOCAB = 97


def next_token(context: list[int]) -> int:
    h = 17
    for pos, tok in enumerate(context):
        h = (h * 1_000_003 + tok * 31 + pos) % 2_147_483_647
    return 3 + h % (VOCAB - 3)  # ids 0..2 are special, never produced unless eos is set


def reference(prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out


class FakeRunner:
    """Computes each step when it is launched (steps are collected in launch order, so this is
    what a worker thread would do); a deferred input reads the token this runner last produced
    for the row, exactly as the real runner's buffer. `accept` decides how many proposed tokens
    a step accepts (default: those equal to the reference continuation)."""

    def __init__(self, num_slots: int, forward_s: float | None = None,
                 bursts: bool = True) -> None:
        self.forward_s = forward_s  # reported as each decode step's forward time (None: none)
        self.bursts = bursts  # False: a burst (ForwardBatch.decode_steps) runs its first step only
        self.kv: dict[int, tuple[int, int]] = {}
        self.table: dict[int, dict[int, int]] = {}
        self.num_slots = num_slots
        self.batches: list[ForwardBatch] = []
        self.row_tokens: dict[int, int] = {}
        self.fail_next = False

    def launch(self, batch: ForwardBatch) -> DoneStep:
        if self.fail_next:
            self.fail_next = False
            return DoneStep(None, RuntimeError("injected failure"))
        try:
            return DoneStep(self.run(batch))
        except Exception as exc:  # noqa: BLE001 - surfaces at result(), as a real step's would
            return DoneStep(None, exc)

    def close(self) -> None:
        pass

    def run(self, batch: ForwardBatch) -> StepOutput:
        batch.input_ids = list(batch.input_ids)  # the scheduler's copy stays as it built it
        for flat in batch.deferred_inputs:
            row = batch.rows[_owner(batch, flat)]
            batch.input_ids[flat] = self.row_tokens[row]
        self.batches.append(batch)
        assert len(batch.input_ids) == len(batch.out_slots) == sum(batch.extend_lens)
        assert len(set(batch.out_slots)) == len(batch.out_slots), "a slot written twice"
        assert 0 not in batch.out_slots, "the padding slot was handed out"
        for prefix in batch.row_prefixes:
            row = self.table.setdefault(prefix.row, {})
            for pos, slot in enumerate(prefix.slots):
                row[pos] = slot
        offset = 0
        contexts = []
        for row_id, start, n in zip(batch.rows, batch.prefix_lens, batch.extend_lens):
            row = self.table.setdefault(row_id, {})
            for k in range(n):
                slot = batch.out_slots[offset + k]
                self.kv[slot] = (batch.input_ids[offset + k], start + k)
                row[start + k] = slot
            offset += n
            context = []
            for pos in range(start + n):
                tok, written_pos = self.kv[row[pos]]
                assert written_pos == pos, (
                    f"slot {row[pos]} holds position {written_pos}, not {pos}")
                context.append(tok)
            contexts.append(context)
        bound = batch.max_shared_prefix
        if bound is not None:  # no two rows hold the same slot at that position (nor past it)
            held = [self.table[r][bound] for r, p in zip(batch.rows, batch.prefix_lens)
                    if p > bound]
            assert len(set(held)) == len(held), f"rows share more than {bound} slots"
        if batch.decode_steps > 1:
            return self._burst(batch, contexts)
        out: list[list[int]] = []
        proposed = batch.proposed or [[] for _ in batch.sample_indices]
        for i, guess in zip(batch.sample_indices, proposed, strict=True):
            context = contexts[i][: len(contexts[i]) - len(guess)]
            tokens = []
            for g in [*guess, None]:  # the model's token at each position, until one differs
                tokens.append(next_token(context))
                if tokens[-1] != g:
                    break
                context = context + [g]
            out.append(tokens)
            self.row_tokens[batch.rows[i]] = tokens[-1]
        return StepOutput(sampled_token_ids=out, logprobs=[[] for _ in out],
                          timings=self._timings(1))

    def _burst(self, batch: ForwardBatch, contexts: list[list[int]]) -> StepOutput:
        """A burst of decode steps: each request's next input the token it sampled last, its
        K/V to its slot of batch.later_slots, read back through the table as any step's."""
        b, steps = batch.batch_size, batch.decode_steps
        later = batch.later_slots
        assert batch.num_tokens == b and len(later) == (steps - 1) * b
        assert len({*later, *batch.out_slots}) == len(later) + b, "a slot given twice"
        out = [[next_token(context)] for context in contexts]
        for j in range(1, steps if self.bursts else 1):
            if not batch.burst_stops.isdisjoint(tokens[-1] for tokens in out):
                break
            for i, (row_id, start) in enumerate(zip(batch.rows, batch.prefix_lens)):
                slot = later[(j - 1) * b + i]
                self.kv[slot] = (out[i][-1], start + j)
                row = self.table[row_id]
                row[start + j] = slot
                out[i].append(next_token([self.kv[row[pos]][0] for pos in range(start + j + 1)]))
        for row_id, tokens in zip(batch.rows, out):
            self.row_tokens[row_id] = tokens[-1]
        return StepOutput(sampled_token_ids=out, logprobs=[], timings=self._timings(len(out[0])))

    def _timings(self, steps: int) -> dict[str, float]:
        return {} if self.forward_s is None else {"forward": self.forward_s * steps}


def _owner(batch: ForwardBatch, flat: int) -> int:
    """Batch index of the request whose new tokens include flat token `flat`."""
    end = 0
    for i, n in enumerate(batch.extend_lens):
        end += n
        if flat < end:
            return i
    raise IndexError(flat)
