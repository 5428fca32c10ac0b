"""A request's scheduling state. Small on purpose: feature state lives beside it, not in it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from banyan.batch import SamplingRow, TokenLogprobs
from banyan.sampling.params import SamplingParams

if TYPE_CHECKING:
    from banyan.structured.grammar import GrammarState


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TextStream(Protocol):
    """Turns generated token ids into safe-to-emit text and spots stop strings."""

    def push_text(self, token_id: int) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string completed: the text is trimmed
        before it and the request ends)."""
        ...

    def finish(self) -> str:
        """Held-back text, released when the request ends for another reason."""
        ...

    # Optional, on a kind of stream that never reports a stop (no stop strings): a static
    # `push_many(streams, tokens) -> list[str]`, push_text's texts for one token on each of
    # many streams of that kind at once (the decode lane's steps).


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # effective: clipped so prompt + output fits max_model_len
    eos_ids: frozenset[int] = frozenset()
    namespace: str | None = None  # cache_salt: requests of different namespaces share no KV
    text: TextStream | None = None
    grammar: GrammarState | None = None  # structured output: advanced by the runner only

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # prompt_logprobs[i] scores prompt token i + 1 (the first token has no context to score it)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None

    # KV state. slots[i] holds the KV of token i; len(slots) tokens are computed.
    slots: list[int] = field(default_factory=list)
    row: int | None = None  # request-to-token table row while running
    cache_handle: Any = None  # locked prefix-cache node
    locked_len: int = 0  # slots[:locked_len] belong to the prefix cache (locked)
    row_synced: int = 0  # slots[:row_synced] are already written into the table row
    written: int = 0  # slots[:written] hold K/V of collected steps (the rest: a step in flight)
    # Slots taken ahead for its next decode tokens (a contiguous run, so its K/V stays in runs),
    # last to be used first; not yet in `slots`.
    decode_run: list[int] = field(default_factory=list)

    # Overlap scheduling: tokens sampled by launched steps whose output is not applied yet (0 or
    # 1), and launched steps that include this request and are not yet collected. A request
    # that ends while a step still reads its KV keeps its slots until that step is collected.
    pending: int = 0
    inflight: int = 0
    # Its decode steps' SamplingRow, made once when sampling reads no history (batch.py).
    sampling_row: SamplingRow | None = None
    # Tokens that stop it: its stop_token_ids, and EOS unless ignore_eos (looked up once per
    # generated token; often the engine's own eos_ids set).
    stop_ids: frozenset[int] = field(init=False, repr=False)

    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    # P/D decode worker: prompt tokens whose K/V a prefill worker computed and sent. They reach
    # the scheduler through the prefix cache but were computed for this request: not cache hits.
    transferred: int = 0
    num_retractions: int = 0
    arrival_seq: int = 0

    def __post_init__(self) -> None:
        eos = frozenset() if self.params.ignore_eos else self.eos_ids
        stops = self.params.stop_token_ids
        self.stop_ids = eos.union(stops) if stops else eos

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        return len(self.slots)

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to be computed before the next token can be sampled (a
        pending token counts: its value arrives before the step that computes it runs)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending - len(self.slots)

    @property
    def generated(self) -> int:
        """Tokens generated so far, pending ones included."""
        return len(self.output_ids) + self.pending

    @property
    def ends_with_pending(self) -> bool:
        """Its pending token is its last (max_new_tokens reached): nothing more to schedule."""
        return self.pending > 0 and self.generated >= self.max_new_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed yet: its prompt positions
        must go through the model (a cached prefix has K/V but no logits)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class RequestUpdate(msgspec.Struct, gc=False):
    """What one step did to one request: the new tokens and text, and whether it ended.
    A msgspec Struct rather than a dataclass: one is made per running request per step, and
    a Struct is made in a third of the time (not tracked by the garbage collector: it holds
    no references back to anything that could close a cycle)."""

    rid: str
    new_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = []  # (msgspec copies an empty default per instance)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # The prompt's logprobs (Request.prompt_logprobs), all at once, in the update that carries
    # the request's first token (or ends a max_new_tokens=0 request).
    prompt_logprobs: list[TokenLogprobs] = []
