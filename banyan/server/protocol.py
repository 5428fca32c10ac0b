"""Request bodies of the HTTP API (pydantic), and their translation into SamplingParams.

Shapes follow OpenAI's API plus the extensions vLLM and SGLang accept (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, cache_salt, ...). Unknown fields
are ignored, as both engines do, so clients that send newer OpenAI fields keep working; the
known ones that would change the output and that Banyan does not implement are refused when
set (`_SamplingFields.NOT_IMPLEMENTED`), never ignored. Responses are plain dicts built in
`openai_format`.

Every field is checked to what the engine can carry (the rule lives here, once): strict types
(no true -> 1, no "1" -> 1), integers within int64 (msgpack carries no more, and no count of
tokens comes near), finite floats; strings are valid Unicode by the time they get here, because
`errors.read_body` parses with pydantic's JSON parser, which refuses lone surrogates.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator

from banyan.sampling.params import MAX_TOP_LOGPROBS, SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_BAD_WORDS = 1000

TokenId = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

# strict: JSON numbers only for numbers (ints are fine for floats), JSON booleans only for bools.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", **_STRICT)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extra: with include_usage, every chunk's usage so far (its choice's tokens)
    continuous_usage_stats: bool = False


class KVTransferParams(_Body):
    """P/D disaggregation, sent by the router to a decode worker (vLLM's field name): where the
    prompt's K/V was computed."""

    remote_addr: str = Field(min_length=1, max_length=256, pattern=r"^tcp://[^\s]+:\d+$")


class _Routing(_Body):
    """Where a request's prompt K/V lives: its cache namespace, and (P/D) its prefill worker."""

    cache_salt: str | None = Field(default=None, min_length=1)
    kv_transfer_params: KVTransferParams | None = None

    @property
    def kv_source(self) -> str | None:
        return None if self.kv_transfer_params is None else self.kv_transfer_params.remote_addr


class _SamplingFields(_Routing):
    """Sampling fields shared by completions and chat."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None  # vLLM's extra
    # vLLM's extra, tokenized by the server (tokens.py). At most MAX_BAD_WORDS: every step
    # matches each against the output (Zen 5: 10,000 words ~2.4 ms a step, 1,000 ~0.2).
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    # vLLM's extra: the prompt's last k tokens only (-1: as many as leave the request's
    # max_tokens, at least one, room: ServerState.prompt_room)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's extra
    # vLLM's extra: the prompt's and each choice's token ids beside the text (streams: the
    # prompt's with a choice's first chunk, each chunk's own new tokens)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's extra: logprobs' tokens as "token_id:N"
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output (OpenAI, vLLM), read by banyan/server/structured_api.py.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's extras that change what is generated and that Banyan does not implement: a 400
    # naming the field when set (false, empty and null are unset), where an engine that ignored
    # them would return other text than the client asked for.
    NOT_IMPLEMENTED: ClassVar[tuple[str, ...]] = ("use_beam_search", "logits_processors")
    use_beam_search: Any = None
    logits_processors: Any = None
    best_of: int | None = Field(default=None, ge=1, le=INT64_MAX)  # legacy OpenAI: = n only

    @field_validator(*NOT_IMPLEMENTED)
    @classmethod
    def _not_implemented(cls, value: Any) -> Any:
        if value not in (None, False, [], {}):
            raise ValueError("not supported by this server")
        return value

    @field_validator("include_stop_str_in_output", "return_token_ids",
                     "return_tokens_as_token_ids", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value  # (vLLM declares these bool | None)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (the context's length) or at least 1")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)  # (declared before best_of: validated first)
        if value is not None and value != n:
            raise ValueError(f"only best_of = n ({n}) is supported, which returns every "
                             "completion generated")
        return value

    def truncated(self, ids: list[int], room: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it: its last k ids (-1: `room`, the
        most that leave the completion room: ServerState.prompt_room)."""
        k = room if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        # (a room of none: max_tokens alone overflows, which max_new_tokens then says)
        return ids if k is None or k < 1 or len(ids) <= k else ids[len(ids) - k:]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and
                                           self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_new_tokens: int, logprobs: int | None,
                        defaults: dict[str, float] | None = None) -> SamplingParams:
        """defaults: the model's generation_config.json values, used where the request is
        silent (model_files.sampling_defaults); OpenAI's defaults after them."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        d = defaults or {}
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=int(d.get("top_k", -1)) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            repetition_penalty=(d.get("repetition_penalty", 1.0) if self.repetition_penalty is None
                                else self.repetition_penalty),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            # str keys as JSON sends them; SamplingParams.validate() turns them into ints
            logit_bias=dict(self.logit_bias or {}),  # type: ignore[arg-type]
            allowed_token_ids=(None if self.allowed_token_ids is None
                               else list(self.allowed_token_ids)),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's extra

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: of strings, or of token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow", **_STRICT)
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"message content of type {part.type!r} is not supported "
                                     "(text only)")
                texts.append(part.text)
            data["content"] = "".join(texts)
        elif self.content is None:
            data["content"] = ""
        return data


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    # deprecated by OpenAI, still sent
    max_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's extra: a template of the request's own
    tools: Any = None  # checked by banyan/server/structured_api.py
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class NativeSamplingParams(_Body):
    """SGLang's /generate `sampling_params`."""

    max_new_tokens: int = Field(default=128, ge=0, le=INT64_MAX)
    min_new_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT64_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    n: int = Field(default=1, ge=1, le=INT64_MAX)
    seed: Int64 | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output (SGLang's names, and vLLM's), read by banyan/server/structured_api.py.
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None  # refused (400), so it is never silently ignored
    structured_outputs: Any = None

    def to_params(self, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, n=self.n, seed=self.seed,
            include_stop_str_in_output=self.no_stop_trim,
            logit_bias=dict(self.logit_bias or {}),  # type: ignore[arg-type]
            logprobs=logprobs,
        )


class GenerateRequest(_Routing):
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    rid: str | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # (messages: as chat renders them)
    chat_template: str | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]

