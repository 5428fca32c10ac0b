"""What the offline API returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from banyan.batch import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (n > 1 gives several, sharing the prompt)."""

    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(slots=True)
class RequestOutput:
    """A finished request. `text`, `output_ids`, ... are those of the first sample; all samples
    are in `outputs`."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def output_ids(self) -> list[int]:
        return self.outputs[0].output_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass(slots=True)
class StreamChunk:
    """A delta of one sample: new tokens and the text now safe to show."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
