"""Request-to-token table: (row, position) -> KV slot.

Each running request owns one row (handed out by the scheduler). Entries past a request's
length are stale or 0 (the padding slot) and are never read unmasked.
"""

from __future__ import annotations

import numpy as np
import torch

from banyan.batch import ForwardBatch
from banyan.host_tensors import to_device


class ReqToTokenTable:
    def __init__(
        self,
        max_rows: int,
        max_context: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.int32,
    ) -> None:
        if max_rows < 1 or max_context < 1:
            raise ValueError(
                f"table needs max_rows >= 1 and max_context >= 1, got {max_rows}, {max_context}"
            )
        self.max_rows = max_rows
        self.max_context = max_context
        self.device = torch.device(device)
        # int32 halves the table (rows x 128K positions adds up); gathers cast to int64 once
        # per step.
        self.table = torch.zeros((max_rows, max_context), dtype=dtype, device=self.device)

    def write(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """rows, positions, slots: [N] on the table's device -> table[rows, positions] = slots."""
        if self.device.type == "cpu":  # numpy's fancy assignment: ~2/3 of index_put_'s cost
            self.table.numpy()[rows.numpy(), positions.numpy()] = slots.numpy()
            return
        self.table.index_put_((rows, positions), slots.to(self.table.dtype))

    def write_ahead(self, rows: torch.Tensor, positions: torch.Tensor,
                    later_slots: torch.Tensor) -> None:
        """A burst's later decode steps (ForwardBatch.decode_steps): table[rows[i],
        positions[i] + j] = later_slots[j - 1, i] for j = 1..steps-1 (rows, positions: [B]).
        On CPU through numpy alone: a torch op costs ~10-20 us here, its dispatcher's code and
        data cold after the step before streamed the weights."""
        ahead = later_slots.shape[0]
        if self.device.type == "cpu":
            rows_np, at = rows.numpy(), positions.numpy()
            steps = np.arange(1, ahead + 1).reshape(ahead, 1)
            self.table.numpy()[rows_np, at + steps] = later_slots.numpy()
            return
        steps_t = torch.arange(1, ahead + 1, device=self.device).unsqueeze(1)
        self.write(rows.repeat(ahead), (positions + steps_t).flatten(), later_slots.flatten())

    def write_batch(
        self,
        batch: ForwardBatch,
        token_rows: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
    ) -> None:
        """Write a step's prefix-cache hits (`row_prefixes`) and new tokens in one index_put.

        token_rows/positions/out_slots: [T] of the new tokens (the runner built them anyway).
        """
        if not batch.row_prefixes:
            self.write(token_rows, positions, out_slots)
            return
        lens = [len(p.slots) for p in batch.row_prefixes]
        pre_slots = [s for p in batch.row_prefixes for s in p.slots]  # C-speed flatten
        lens_t = torch.tensor(lens, dtype=torch.int64)
        pre_rows = torch.repeat_interleave(
            torch.tensor([p.row for p in batch.row_prefixes], dtype=torch.int64), lens_t
        )
        starts = torch.repeat_interleave(torch.cumsum(lens_t, 0) - lens_t, lens_t)
        pre_pos = torch.arange(len(pre_slots), dtype=torch.int64) - starts
        dev = self.device
        self.write(
            torch.cat((to_device(pre_rows, dev), token_rows)),
            torch.cat((to_device(pre_pos, dev), positions)),
            torch.cat((to_device(torch.tensor(pre_slots, dtype=torch.int64), dev), out_slots)),
        )

    def read(self, row: int, length: int) -> torch.Tensor:
        """Slots of positions [0, length) of `row` (a view)."""
        return self.table[row, :length]
