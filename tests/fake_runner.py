"""A model-free Runner for scheduler tests.

It keeps its own request-to-token table and a "KV store" mapping each slot to the (token,
position) written there, and its next token is a hash of the context it reads back through the
table. So a scheduler bug that reads a wrong or overwritten slot, a stale row, or a wrong position
changes the output, exactly as it would with a real model.
"""

from __future__ import annotations

from banyan.batch import ForwardBatch, StepOutput

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
    def __init__(self, num_slots: int) -> None:
        self.kv: dict[int, tuple[int, int]] = {}
        self.table: dict[int, dict[int, int]] = {}
        self.num_slots = num_slots
        self.batches: list[ForwardBatch] = []

    def run(self, batch: ForwardBatch) -> StepOutput:
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
                assert written_pos == pos, f"slot {row[pos]} holds position {written_pos}, not {pos}"
                context.append(tok)
            contexts.append(context)
        tokens = [next_token(contexts[i]) for i in batch.sample_indices]
        return StepOutput(next_tokens=tokens, logprobs=[None] * len(tokens))
