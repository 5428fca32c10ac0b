"""What crosses the scheduler/runner boundary: one plain dataclass each way.

The scheduler describes a step as a `ForwardBatch` of Python lists (no torch), the runner turns it
into tensors, runs the model and the sampler, and answers with a `StepOutput`. Both sit at the
bottom of the package so the scheduler, runner, attention backends and models share them without
importing each other.

Token layout of one step (vLLM/SGLang style "flat" batch): request i contributes
`extend_lens[i]` new tokens, whose KV goes to positions `[prefix_lens[i], prefix_lens[i] +
extend_lens[i])` of its row in the request-to-token table. A decode is simply an extend of one
token. All new tokens are concatenated in request order into `input_ids` / `out_slots`.

Several tokens per request: a request that samples may end its extend with `proposed` tokens (a
speculative guess); the runner computes logits at each of them and at the token before, and
answers with 1..k+1 tokens for it (`StepOutput.sampled_token_ids`). With overlap, an input
token may not be known yet when the step is built: it is "the token the previous step samples
for this row", named in `deferred_inputs` and filled by the runner from its per-row buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from banyan.sampling.params import SamplingParams

if TYPE_CHECKING:
    from banyan.structured.grammar import GrammarState


@dataclass(slots=True)
class SamplingRow:
    """Everything the sampler needs about one request that samples a token this step: a
    snapshot taken when the step is built, so the request may move on (overlap) meanwhile.
    A request whose sampling reads nothing of its history (not `params.reads_history`) keeps
    one row while it runs in a table row, reused by every decode step: its output_ids,
    num_output and pending are then those of the step that made it, which nothing reads."""

    params: SamplingParams
    prompt_ids: list[int]  # a request's prompt never changes after it is queued
    # Tokens generated so far, copied only when a penalty needs them (else empty: copying every
    # output every step would cost O(total output) per step).
    output_ids: list[int]
    # Seeded requests draw their noise from (seed, num_output): the same seed gives the same
    # tokens whatever else is in the batch, and a retracted request resumes identically.
    seed: int | None = None
    num_output: int = -1  # tokens generated so far, pending ones included (-1: len(output_ids))
    row: int = -1  # the request's table row (the runner's per-row token buffer)
    # Tokens sampled by a step still running when this one was built (overlap: 0 or 1), not in
    # output_ids; the runner appends them from its buffer when a penalty needs them.
    pending: int = 0
    # The request's grammar matcher (structured output), shared, not a snapshot: the runner
    # fills its masks and advances it in step order (banyan/structured/masks.py).
    grammar: GrammarState | None = None
    # Greedy with nothing that changes or reports its logits (params.plain_greedy), decided
    # once per row: the sampler's whole-batch argmax when every row is.
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain = self.params.plain_greedy and self.grammar is None

    @property
    def generated(self) -> int:
        return self.num_output if self.num_output >= 0 else len(self.output_ids)


@dataclass(slots=True)
class RowPrefix:
    """KV slots already holding a request's first tokens (a prefix-cache hit), to be written into
    table row `row` at positions [0, len(slots)) before the step runs."""

    row: int
    slots: list[int]


@dataclass(slots=True)
class PromptLogprobSpan:
    """Prompt logprobs a request asks for in this step: the logits at the first `count` new
    tokens of batch entry `index` (sequence positions `position`...), each scored against the
    prompt token that follows it (`targets`)."""

    index: int  # into the batch (0..B-1)
    position: int  # of its first new token: the span scores prompt tokens position+1...
    targets: list[int]  # [count] the next prompt token after each position
    top_k: int  # alternatives per position

    @property
    def count(self) -> int:
        return len(self.targets)


@dataclass(slots=True)
class ForwardBatch:
    """One step of work: per request (in batch order) its table row and token counts, plus the
    flat new tokens and the KV slots they are written to."""

    rows: list[int] = field(default_factory=list)  # [B] request-to-token table rows
    prefix_lens: list[int] = field(default_factory=list)  # [B] tokens already in KV
    extend_lens: list[int] = field(default_factory=list)  # [B] new tokens this step (>= 1)
    input_ids: list[int] = field(default_factory=list)  # [T = sum(extend_lens)]
    out_slots: list[int] = field(default_factory=list)  # [T] KV slot of each new token
    # Indices into the batch (0..B-1) of requests whose last new token is the last token of their
    # sequence so far: their final position's logits are sampled. Chunked-prefill chunks that do
    # not reach the end of the prompt are absent.
    sample_indices: list[int] = field(default_factory=list)
    sampling: list[SamplingRow] = field(default_factory=list)  # [len(sample_indices)]
    # [len(sample_indices)] speculative tokens ending each sampling request's extend (empty: none)
    proposed: list[list[int]] = field(default_factory=list)
    row_prefixes: list[RowPrefix] = field(default_factory=list)
    # Flat indices of input_ids whose token is the one the previous step samples for the same
    # table row (overlap scheduling); input_ids holds 0 there until the runner fills it in.
    deferred_inputs: list[int] = field(default_factory=list)
    # Requests that want the logits at prompt positions too (prompt logprobs); others only get
    # them at their sampling positions.
    prompt_logprobs: list[PromptLogprobSpan] = field(default_factory=list)
    # No two requests of the step hold the same KV slots in more than their first this many
    # positions (shared slots are a cached prefix both locked); None: not known. Lets the
    # attention backends skip looking for shared prefixes (prefix_groups.py) every step.
    max_shared_prefix: int | None = None
    # A burst (decodes only, every request plain greedy): the step's decodes run decode_steps
    # times back to back, each sub-step's input the token the sub-step before sampled, so the
    # host's work (this batch, its tensors, the tokens' text) is done once for them all.
    # later_slots [(decode_steps - 1) * B]: the KV slots of sub-steps 1.. inputs, sub-step by
    # sub-step. The runner answers the same number of tokens, 1..decode_steps, for every
    # request: it stops after a sub-step that sampled one of burst_stops (any request's stop
    # tokens), and a runner that cannot burst answers one.
    decode_steps: int = 1
    later_slots: list[int] = field(default_factory=list)
    burst_stops: frozenset[int] = frozenset()

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_lens)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the chosen token and, when asked, the top-k alternatives."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0  # 1 + tokens more likely than this one (0: not computed; prompt logprobs only)


@dataclass(slots=True)
class StepOutput:
    """The runner's answer, per entry of `ForwardBatch.sample_indices`: the tokens it produced
    (one without proposals; with k proposals, the accepted ones plus the model's own next token,
    1..k+1; in a burst one a decode step run, the same count for all) and their logprobs (empty
    unless asked for)."""

    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    # Per entry of ForwardBatch.prompt_logprobs, one TokenLogprobs per position of the span.
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    # Seconds spent in each phase of the step (prepare, forward, sample), for telemetry.
    timings: dict[str, float] = field(default_factory=dict)
