"""Which running requests share a cached prefix: groups for cascade attention (cascade.py).

With RadixAttention the table rows of requests that matched the same cached prefix hold the
same KV slots at the same positions, and a slot belongs to one radix-tree node: two rows holding
the same slot at position c share the whole path [0, c]. So the slots at a few probe positions
(c = m*2^j - 1 for the minimum prefix m) place every request in a small trie whose node at probe
c holds the requests sharing at least c + 1 slots. A tree DP then picks disjoint nodes
maximising the prefix rows saved, (members - 1) * (c + 1): distinct system prompts that only
share a chat-template opening split at the first probe past it, and one request that shares
less with the others does not drag their group down. Finally every chosen group is verified by
comparing its rows with its first row (one vectorised compare for all groups), which gives the
exact shared length P; the trie is only a guess, the compare is the truth, so a table that breaks
the one-node-per-slot rule costs speed, never correctness.

Cost per step: one gather of [requests, probes] slots, one [members, Lmax] compare, and
Python per request and probe (never per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from banyan.host_tensors import int64_tensor


@dataclass(frozen=True, slots=True)
class CascadePolicy:
    """When a group of requests sharing a prefix takes the cascade path.

    The cascade costs ~20 small kernels per layer plus ~10 per group (~0.1 ms on a 2-core
    CPU), and its own-part attention is unfused, slower per token than SDPA; it saves gathering
    and attending the prefix once per extra member. Measured for decodes on CPU (KVH=3, G=3,
    D=64, bf16 and float32), the break-even is at (Bg - 1) * P of 2,000-3,000 token rows:
    e.g. Bg=4, P=1024: 0.85x the plain time; Bg=8, P=256: 1.1x; Bg=64, P=64 with ~64 own
    tokens each: 1.0x; Bg=64, P=1024: 0.2-0.25x.
    """

    min_prefix: int = 32  # shortest shared prefix P considered
    min_saved: int = 4096  # least (Bg - 1) * P, the prefix rows per layer the cascade saves
    # Extends (prefill chunks over a cached prefix) gain less: their per-request SDPA already
    # reuses each gathered key for n queries, so the cascade only wins where its one big
    # prefix SDPA dominates its padded, unfused own parts. Measured on CPU (KVH=3, G=3, D=64),
    # 0.8-0.9x the plain time at n <= 32 and P >= 16x the own part (own cached tail + new
    # tokens), about 1.0-1.15x at n >= 64 or P = 8x. Extends of more new tokens, or over a
    # shorter prefix, stay on the plain path.
    max_extend: int = 32
    extend_prefix_ratio: int = 16
    # Bound on the padded own-part block, rows x queries x own length (x query heads x 4
    # bytes of float32 scores: 64 MiB at 32 heads): a plan past it runs the plain way instead.
    max_own_block: int = 1 << 19

    def __post_init__(self) -> None:
        if (
            min(self.min_prefix, self.min_saved, self.max_own_block) < 1
            or self.max_extend < 1
            or self.extend_prefix_ratio < 0
        ):
            raise ValueError(f"CascadePolicy thresholds out of range: {self}")


@dataclass(slots=True)
class SharedPrefix:
    """Requests (indices into the lists given to `find_shared_prefixes`, ascending) whose table
    rows hold the same slots at positions [0, length)."""

    members: list[int]
    length: int  # P


@dataclass(slots=True)
class _Node:
    length: int  # c + 1: members share at least this many slots (if the table keeps the rule)
    members: list[int] = field(default_factory=list)
    children: dict[int, _Node] = field(default_factory=dict)


def find_shared_prefixes(
    table: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    policy: CascadePolicy,
    max_shared: int | None = None,
) -> list[SharedPrefix]:
    """Disjoint groups of >= 2 requests sharing P >= policy.min_prefix slots with
    (members - 1) * P >= policy.min_saved. P is capped at every member's prefix_len (tokens
    already in KV), so each keeps at least its new tokens in its own part.

    table: [rows, max_context] slot table; rows/prefix_lens: per request; max_shared: what
    the scheduler knows of the longest shared prefix (ForwardBatch.max_shared_prefix).
    """
    if max_shared is not None and max_shared < policy.min_prefix:
        return []  # (~0.14 ms a step at 256 decodes on Zen 3, its caches cold after a forward)
    usable = prefix_lens  # the longest prefix a request may share
    if min(usable, default=0) >= policy.min_prefix:  # everyone (the usual decode step)
        eligible: Sequence[int] = range(len(usable))
    else:
        eligible = [i for i, u in enumerate(usable) if u >= policy.min_prefix]
    if len(eligible) < 2:
        return []
    longest = max(usable) if len(eligible) == len(usable) else max(usable[i] for i in eligible)
    probes: list[int] = []  # probe columns c, shared length c + 1 <= longest
    c = policy.min_prefix
    while c <= longest:
        probes.append(c - 1)
        c *= 2
    device = table.device
    eligible_rows = rows if len(eligible) == len(rows) else [rows[i] for i in eligible]
    if _all_distinct(table, eligible_rows, probes[0]):
        return []  # nobody shares even the first probe: the usual step without sharing
    rows_t = int64_tensor(eligible_rows).to(device)
    probes_t = torch.tensor(probes, dtype=torch.int64).to(device)
    keys = table[rows_t[:, None], probes_t[None, :]].tolist()  # [E, J]: one small read

    root = _Node(0)
    for pos, i in enumerate(eligible):
        node = root
        for col, key in zip(probes, keys[pos], strict=True):
            if col + 1 > usable[i]:
                break
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(col + 1)
            child.members.append(pos)
            node = child
    chosen = [n for child in root.children.values() for n in _best(child)[1]]
    if not chosen:
        return []

    # Exact shared length: every member against its group's first row.
    members = [pos for n in chosen for pos in n.members]
    leaders = [n.members[0] for n in chosen for _ in n.members]
    cap = max(usable[eligible[pos]] for pos in members)
    sel = torch.tensor(members, dtype=torch.int64).to(device)
    lead = torch.tensor(leaders, dtype=torch.int64).to(device)
    diff = table[rows_t[sel], :cap] != table[rows_t[lead], :cap]  # [M, cap]
    # First mismatching column (argmax returns the first maximum); cap where there is none.
    first = torch.where(diff.any(1), diff.to(torch.uint8).argmax(1), cap).tolist()
    match = dict(zip(members, first, strict=True))
    out: list[SharedPrefix] = []
    for node in chosen:
        # Past the leader's own length its row holds stale slots; members equal to it there
        # still equal each other, and the cap keeps P inside every member's live entries.
        p = min(min(match[pos], usable[eligible[pos]]) for pos in node.members)
        if p >= policy.min_prefix and (len(node.members) - 1) * p >= policy.min_saved:
            out.append(SharedPrefix(sorted(eligible[pos] for pos in node.members), p))
    return out


def _all_distinct(table: torch.Tensor, rows: list[int], column: int) -> bool:
    """Whether the rows hold distinct slots at `column` (checked every step: on a CPU table
    through numpy, whose calls cost a fraction of torch's: 10 against 40 us for 256 rows)."""
    if table.device.type == "cpu":
        picked = np.sort(table.numpy()[np.fromiter(rows, np.int64, len(rows)), column])
        return bool((picked[1:] != picked[:-1]).all())
    return torch.unique(table[int64_tensor(rows).to(table.device), column]).numel() == len(rows)


def _best(node: _Node) -> tuple[int, list[_Node]]:
    """The disjoint nodes under `node` (itself included) saving the most prefix rows."""
    below, picked = 0, []
    for child in node.children.values():
        gain, nodes = _best(child)
        below += gain
        picked += nodes
    own = (len(node.members) - 1) * node.length
    if len(node.members) >= 2 and own >= below:
        return own, [node]
    return below, picked
