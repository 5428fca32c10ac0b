"""Sampling parameters of one request, validated where they enter the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from banyan.structured.spec import KINDS, StructuredSpec

# Logprobs of more alternatives than this are refused: they cost a top-k over the vocabulary.
MAX_TOP_LOGPROBS = 20
# Temperatures below this are greedy: logits / 1e-6 overflows float32 into inf and the softmax
# into NaN, and the distribution is a point mass anyway (vLLM uses the same epsilon).
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: every other token is banned (None: no such list)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, as the server tokenized them: the last token of each sequence is banned
    # wherever the output ends with the tokens before it (a one-token sequence: always)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k
    # Logprobs of the prompt's own tokens (each from the logits at the position before it), with
    # k alternatives; None: not computed. Such a request recomputes its prompt (prefix cache not
    # read) and may have max_new_tokens=0 (the prompt's logprobs, no token generated).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's include_stop_str_in_output (SGLang's no_stop_trim): the stop string that ended the
    # text stays at its end; the tokens are the same either way.
    include_stop_str_in_output: bool = False
    structured: StructuredSpec | None = None  # constrain the output to a grammar

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def reads_output_ids(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad words): the
        rows then carry them, speculated ones included."""
        return self.uses_penalties or bool(self.bad_words_ids)

    @property
    def plain_greedy(self) -> bool:
        """Greedy, and nothing changes the logits before the argmax (penalties, bias, the
        min_new_tokens ban) or reads them after (logprobs)."""
        return (self.greedy and not self.uses_penalties and not self.logit_bias
                and self.allowed_token_ids is None and not self.bad_words_ids
                and self.min_new_tokens == 0 and self.logprobs is None)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads what the request has generated so far: the tokens
        (penalties, bad words) or their count (a seed's per-position draw, the min_new_tokens
        ban)."""
        return self.reads_output_ids or self.seed is not None or self.min_new_tokens > 0

    def copy(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)  # type: ignore[arg-type]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        ints = ("max_new_tokens", "min_new_tokens", "top_k", "n")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty")
        for name in floats:
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise bad(name, "must be a finite number")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            raise bad("min_new_tokens", "must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not (
                isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        # JSON clients send logit_bias keys as strings ({"50256": -100}).
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"invalid sampling parameter logit_bias[{key!r}]={value!r}: token ids must be"
                    " integers and biases numbers"
                ) from None
            if not math.isfinite(bias[int(key)]):
                raise ValueError(f"invalid sampling parameter logit_bias[{key!r}]={value!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must hold at least one token id")
        if not all(self.bad_words_ids):
            raise bad("bad_words_ids", "every sequence needs at least one token")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", bias),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words_ids", [t for word in self.bad_words_ids for t in word])):
            for token_id in ids:
                if isinstance(token_id, bool) or not isinstance(token_id, int):
                    raise ValueError(f"invalid sampling parameter {name}: token id "
                                     f"{token_id!r} is not an int")
                if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                    where = "negative" if vocab_size is None else f"outside [0, {vocab_size})"
                    raise ValueError(f"invalid sampling parameter {name}: token id {token_id} "
                                     f"is {where}")
        self.logit_bias = bias
        if self.structured is not None and self.structured.kind not in KINDS:
            raise ValueError(f"invalid structured output kind {self.structured.kind!r}")
