"""Streaming text from streaming tokens: incremental detokenization and stop strings.

Per request, the serving side keeps one `TextAccumulator` and, for each generated token,
`delta = acc.push(token_id)`; it streams `delta.text` and ends the request when `delta.stopped`
(a stop string completed; the stop string itself is not emitted unless the request asks
for it: include_stop_str_in_output). When the request ends for
another reason (EOS, a stop token, max_new_tokens, abort), `acc.finish()` returns the text still
held back. `acc.text` is the whole output text so far and always equals the concatenation of
everything emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from banyan.engine.byte_detok import ByteDetokenizer, ByteTextStream, TokenBytes
from banyan.sampling.params import SamplingParams

# Prompt tokens decoded as left context of the first output token: tokenizers that strip the
# leading space of a decode (SentencePiece/Metaspace) need one real token before the new one, and
# five is what vLLM uses, enough to also cover a multi-byte character cut by the window start.
PROMPT_CONTEXT = 5
REPLACEMENT = "\ufffd"
MAX_UTF8_BYTES = 4


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


def _decoder_of(tokenizer: Any) -> _Decoder:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer (one call, no Python
    post-processing such as clean_up_tokenization_spaces, which is not incremental), else the
    tokenizer itself (a raw `tokenizers.Tokenizer`, or a slow transformers tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None else tokenizer


class IncrementalDetokenizer:
    """Decodes one token at a time (the prefix/read offset method of vLLM and TGI).

    The window `_ids` holds the tokens since the last emission point: `_ids[:_read]` were emitted
    already (context), the rest are pending. Each push decodes the context and the whole window;
    the new text is the whole past the context. Decoding a window rather than the single token
    keeps the spaces SentencePiece decoders strip from the start of a decode and merges the bytes
    of a character split across tokens. While the window's text ends in U+FFFD (an incomplete
    UTF-8 sequence) nothing is emitted, for at most 3 tokens that complete nothing: a 4th means
    the sequence is invalid, and the text goes out with its U+FFFD.

    Concatenated deltas (plus `finish()`) equal decode(prompt + output) past decode(prompt) for
    any text that is valid UTF-8. (For invalid byte sequences from byte-fallback tokenizers the
    replacement characters may sit differently than in a one-shot decode, which replaces a whole
    invalid run of byte tokens: no streaming decoder can know the run's end in advance.)

    Not `tokenizers.decoders.DecodeStream` (0.23): measured on the tokenizers of the tests, it
    raises on invalid byte-fallback runs, has no flush for a trailing incomplete character, and
    with prompt ids as context mangles the first output characters when the prompt window starts
    inside a byte-fallback run.
    """

    __slots__ = ("_decoder", "_skip", "_ids", "_read", "_complete", "_stuck")

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._decoder = _decoder_of(tokenizer)
        self._skip = skip_special_tokens
        self._ids: list[int] = self._prompt_window(prompt_ids)
        self._read = len(self._ids)
        # While the window's text ends in U+FFFD: the length of its text before those, and how
        # many pushes in a row left that unchanged (no new complete character).
        self._complete = -1
        self._stuck = 0

    def _prompt_window(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last PROMPT_CONTEXT prompt tokens, moved back (by at most 3 tokens, a UTF-8
        character being 4 bytes at most) while they begin inside a character. Byte-fallback
        decoders turn a whole run of <0xNN> tokens into U+FFFD when the run starts mid-character,
        which would hide the first output characters that continue the run."""
        tail = list(prompt_ids[-(PROMPT_CONTEXT + MAX_UTF8_BYTES - 1) :])
        start = max(len(tail) - PROMPT_CONTEXT, 0)
        while start > 0 and self._decode(tail[start:]).startswith(REPLACEMENT):
            start -= 1
        return tail[start:]

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip)

    def _texts(self) -> tuple[str, str]:
        """(text of the context, text of the whole window)."""
        return self._decode(self._ids[: self._read]), self._decode(self._ids)

    def _commit(self, context: str, whole: str) -> str:
        """Emit the window's text past its context; the next context starts at this boundary."""
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._complete, self._stuck = -1, 0
        return whole[len(context) :]

    def push(self, token_id: int) -> str:
        """The text this token completes: "" while a character is still incomplete or the token
        decodes to nothing (a skipped special token)."""
        self._ids.append(token_id)
        context, whole = self._texts()
        if len(whole) <= len(context):
            return ""
        if whole.endswith(REPLACEMENT):
            # Hold back an unfinished character, but not forever: a UTF-8 character has at
            # most 4 bytes, so a sequence still unfinished after MAX_UTF8_BYTES pushes that
            # completed nothing (each token is at least one byte) never completes, and goes out
            # as U+FFFD. A model that emits invalid bytes then streams every few tokens instead
            # of only at the end.
            complete = len(whole.rstrip(REPLACEMENT))
            self._stuck = self._stuck + 1 if complete <= max(self._complete, len(context)) else 0
            self._complete = complete
            if self._stuck < MAX_UTF8_BYTES:
                return ""
            return self._commit_invalid(context)
        return self._commit(context, whole)

    def _commit_invalid(self, context: str) -> str:
        """Emit all but the last 3 pending tokens: they may still begin a valid character
        (an invalid byte followed by an emoji's first 3 bytes), the tokens before cannot."""
        keep = MAX_UTF8_BYTES - 1
        cut = len(self._ids) - keep
        text = self._decode(self._ids[:cut])
        del self._ids[: self._read]
        self._read = len(self._ids) - keep
        self._complete, self._stuck = -1, keep
        return text[len(context) :]

    def finish(self) -> str:
        """Text held back at the end of the stream (an incomplete character, as U+FFFD)."""
        return self._commit(*self._texts())


@dataclass(slots=True)
class StopMatch:
    start: int  # index in the text where the stop string begins
    stop: str  # which stop string


class StopStringMatcher:
    """Finds stop strings in a growing text, looking only where new characters could complete one,
    and says how much of the text's end must be held back because it may begin one."""

    __slots__ = ("stops", "max_len")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: list[str] = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_chars: int) -> StopMatch | None:
        """The earliest stop string in `text` that overlaps its last `new_chars` characters (one
        ending before them was found by an earlier call); ties go to the first in the list."""
        if not self.stops or new_chars <= 0:
            return None
        start = max(0, len(text) - new_chars - self.max_len + 1)
        best: StopMatch | None = None
        for stop in self.stops:
            at = text.find(stop, start)
            if at != -1 and (best is None or at < best.start):
                best = StopMatch(at, stop)
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string:
        those characters cannot be streamed yet."""
        for length in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0


@dataclass(slots=True)
class TextDelta:
    text: str  # safe to send to the client now
    stopped: bool = False  # a stop string completed: end the request, push nothing more
    stop: str | None = None  # the stop string that matched


class EmittedText:
    """A text stream's emitted text, kept as chunks in `_parts` and joined on demand (appending
    to one string would be quadratic)."""

    __slots__ = ()
    _parts: list[str]

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class TextAccumulator(EmittedText):
    """Incremental detokenizer plus stop strings for one request: push tokens, stream what is
    safe (`text`: what was emitted; after `finish()` or a stop, the whole output)."""

    __slots__ = ("_detok", "_matcher", "_plain", "_min_tokens", "_tokens", "_parts", "_pending",
                 "_stopped", "_keep_stop")

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_new_tokens: int = 0,
        token_bytes: TokenBytes | None = None,
        include_stop: bool = False,
    ) -> None:
        # With a byte-level tokenizer's table (TokenBytes.of), one lookup per token instead of
        # two tokenizer decodes; the same text.
        self._detok: IncrementalDetokenizer | ByteDetokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
            if token_bytes is None else
            ByteDetokenizer(token_bytes, prompt_ids, skip_special_tokens))
        self._matcher = StopStringMatcher(stop)
        self._plain = not self._matcher  # no stop strings: nothing to find or hold back
        # As vLLM: stop strings completed before the min_new_tokens-th token do not count (the
        # sampler bans stop tokens until then; text cannot be banned). Partial ones are still
        # held back meanwhile, so one completed by that token can still be cut before it.
        self._min_tokens = min_new_tokens
        self._tokens = 0
        # Emitted text as chunks (joined on demand: appending to one string would be quadratic)
        # and the held-back tail, the only place a stop string can still begin: any emitted
        # suffix that began one would have been held back.
        self._parts = []
        self._pending = ""
        self._stopped = False
        self._keep_stop = include_stop  # the matched stop string ends the text (vLLM's option)

    @classmethod
    def from_params(
        cls, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams,
        token_bytes: TokenBytes | None = None,
    ) -> TextAccumulator:
        return cls(tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                   params.min_new_tokens, token_bytes, params.include_stop_str_in_output)

    @staticmethod
    def for_request(tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams,
                    token_bytes: TokenBytes | None = None) -> TextAccumulator | ByteTextStream:
        """A request's text stream: without stop strings, over a byte table, the one-object
        ByteTextStream (the same text); else a TextAccumulator."""
        if token_bytes is not None and not any(params.stop):
            return ByteTextStream(token_bytes, prompt_ids, params.skip_special_tokens)
        return TextAccumulator.from_params(tokenizer, prompt_ids, params, token_bytes)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, token_id: int) -> TextDelta:
        if self._plain or self._stopped:
            return TextDelta(*self.push_text(token_id))
        self._tokens += 1
        return self._advance(self._detok.push(token_id), final=False)

    def push_text(self, token_id: int) -> tuple[str, bool]:
        """`push` as (text, stopped), without a TextDelta: the scheduler's once-per-token
        call."""
        if self._plain:  # kept lean (a request without stop strings never stops on text)
            new = self._detok.push(token_id)
            if new:
                self._parts.append(new)
            return new, False
        if self._stopped:
            return "", True
        self._tokens += 1
        delta = self._advance(self._detok.push(token_id), final=False)
        return delta.text, delta.stopped

    def finish(self) -> str:
        """Everything still held back (a partial stop string, an incomplete character): call once
        when the request ends for a reason other than a stop string."""
        if self._stopped:
            return ""
        return self._advance(self._detok.finish(), final=True).text

    def _advance(self, new: str, final: bool) -> TextDelta:
        pending = self._pending + new
        armed = self._tokens >= self._min_tokens
        match = self._matcher.find(pending, len(new)) if armed else None
        if match is not None:
            self._stopped = True
            end = match.start + (len(match.stop) if self._keep_stop else 0)
            return self._emit(pending[:end], "", stopped=True, stop=match.stop)
        safe = len(pending) if final else len(pending) - self._matcher.holdback(pending)
        return self._emit(pending[:safe], pending[safe:])

    def _emit(
        self, out: str, held: str, stopped: bool = False, stop: str | None = None
    ) -> TextDelta:
        if out:
            self._parts.append(out)
        self._pending = held
        return TextDelta(out, stopped=stopped, stop=stop)
