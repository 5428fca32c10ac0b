"""What a ForwardBatch must hold before the runner builds a step from it: every index within
the pool, the table and the vocabulary (a bad batch is a ValueError naming the field, never a
kernel reading out of bounds)."""

from __future__ import annotations

from banyan.batch import ForwardBatch


class BatchChecks:
    def __init__(self, max_rows: int, max_context: int) -> None:
        self.max_rows, self.max_context = max_rows, max_context
        self.checked_rows: list[int] = []  # the last rows validated

    def check(self, batch: ForwardBatch, num_slots: int, vocab_size: int) -> None:
        """ValueError on a batch that would index out of the pool, table or vocabulary."""
        b = batch.batch_size
        if b == 0:
            raise ValueError("empty ForwardBatch")
        if len(batch.prefix_lens) != b or len(batch.extend_lens) != b:
            raise ValueError(
                f"ForwardBatch: rows/prefix_lens/extend_lens lengths differ "
                f"({b}, {len(batch.prefix_lens)}, {len(batch.extend_lens)})"
            )
        t = batch.num_tokens
        if len(batch.out_slots) != t or sum(batch.extend_lens) != t:
            raise ValueError(
                f"ForwardBatch: {t} input_ids, {len(batch.out_slots)} out_slots, "
                f"sum(extend_lens)={sum(batch.extend_lens)}"
            )
        if min(batch.extend_lens) < 1 or min(batch.prefix_lens) < 0:
            raise ValueError("ForwardBatch: extend_lens must be >= 1 and prefix_lens >= 0")
        # (steady decode steps repeat their rows: checked once, compared after)
        if batch.rows != self.checked_rows:
            if min(batch.rows) < 0 or max(batch.rows) >= self.max_rows \
                    or len(set(batch.rows)) != b:
                raise ValueError(f"ForwardBatch: rows must be distinct and in "
                                 f"[0, {self.max_rows}), got {batch.rows}")
            self.checked_rows = list(batch.rows)
        if t == b:  # decodes only (every extend is 1): no Python loop over the batch
            longest = max(batch.prefix_lens) + 1
        else:
            longest = max(p + n for p, n in zip(batch.prefix_lens, batch.extend_lens,
                                                strict=True))
        if longest > self.max_context:
            raise ValueError(
                f"ForwardBatch: a sequence reaches {longest} tokens, "
                f"over max_context={self.max_context}"
            )
        # Slot 0 (padding) is allowed: padded tokens may write there.
        _check_range("out_slots", batch.out_slots, num_slots)
        _check_range("input_ids", batch.input_ids, vocab_size)
        if batch.sample_indices:
            _check_range("sample_indices", batch.sample_indices, b)
        if batch.proposed:
            if len(batch.proposed) != len(batch.sample_indices):
                raise ValueError("ForwardBatch: proposed needs one list per sampling request")
            for i, p in zip(batch.sample_indices, batch.proposed, strict=True):
                if len(p) >= batch.extend_lens[i]:
                    raise ValueError(f"ForwardBatch: {len(p)} proposed tokens do not fit an "
                                     f"extend of {batch.extend_lens[i]}")
        if batch.deferred_inputs:
            _check_range("deferred_inputs", batch.deferred_inputs, t)
        if batch.decode_steps != 1:
            _check_burst(batch, self.max_context, num_slots)
        for p in batch.row_prefixes:
            if not 0 <= p.row < self.max_rows or len(p.slots) > self.max_context:
                raise ValueError(
                    f"ForwardBatch: row_prefix for row {p.row} with {len(p.slots)} slots "
                    "is out of range"
                )
            if p.slots:
                _check_range("row_prefixes slots", p.slots, num_slots)


def _check_burst(batch: ForwardBatch, max_context: int, num_slots: int) -> None:
    """A burst's own fields: decodes of plain greedy requests only, a slot per later input."""
    b, steps = batch.batch_size, batch.decode_steps
    if steps < 1:
        raise ValueError(f"ForwardBatch: decode_steps must be >= 1, got {steps}")
    if batch.num_tokens != b or batch.sample_indices != list(range(b)) or batch.proposed \
            or batch.deferred_inputs or batch.prompt_logprobs \
            or not all(row.plain for row in batch.sampling):
        raise ValueError("ForwardBatch: a burst (decode_steps > 1) takes plain greedy decodes "
                         "only, every request sampled")
    if len(batch.later_slots) != (steps - 1) * b:
        raise ValueError(f"ForwardBatch: later_slots needs {(steps - 1) * b} slots for "
                         f"{steps} decode steps of {b} requests, got {len(batch.later_slots)}")
    if max(batch.prefix_lens) + steps > max_context:
        raise ValueError(f"ForwardBatch: a burst of {steps} decode steps reaches past "
                         f"max_context={max_context}")
    _check_range("later_slots", batch.later_slots, num_slots)


def _check_range(what: str, values: list[int], end: int) -> None:
    lo, hi = min(values), max(values)
    if lo < 0 or hi >= end:
        raise ValueError(f"ForwardBatch: {what} must be in [0, {end}), got values in [{lo}, {hi}]")
