"""The API server's tokenizer side: prompts to token ids (chat templates included) and token ids
to the strings and bytes that logprobs show.

Output text is not decoded here: the engine's TextAccumulator streams exact incremental deltas
(see docs/architecture.md), so this side only encodes prompts and names single tokens.

Whatever can take long (a chat template, a long prompt's tokenization) runs off the event loop,
in a small thread pool, under a time limit: one request must not stall every other client and
/health. A template render past the limit is stopped inside the thread (a trace function in the
template's own frames raises); a tokenizer call cannot be stopped, but its caller stops waiting.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any, TypeVar

from banyan.engine.byte_detok import unicode_to_bytes

T = TypeVar("T")

# The file name Jinja gives templates compiled from a string (as chat templates are).
_TEMPLATE_FILE = "<template>"


class TokenizeTimeout(ValueError):
    """Rendering or tokenizing a prompt took longer than the limit: the request is refused."""


def _timeout_message(limit: float) -> str:
    # one message whichever side notices first: the template's own frames or the wait for them
    return f"preparing the prompt took longer than {limit:g} s (the server's --tokenize-timeout)"


def _with_deadline(deadline: float, limit: float, fn: Callable[..., T], *args: Any) -> T:
    """Run fn in this (pool) thread; a chat template still rendering at `deadline` (`limit`
    seconds after the request came) raises TokenizeTimeout from inside its own code."""

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TokenizeTimeout(_timeout_message(limit))
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        # Only template frames are traced: everything else runs at full speed.
        return local if frame.f_code.co_filename == _TEMPLATE_FILE else None

    sys.settrace(tracer)
    try:
        return fn(*args)
    finally:
        sys.settrace(None)


class TokenizerSide:
    def __init__(self, tokenizer: Any, vocab_size: int, threads: int = 4,
                 timeout: float = 10.0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="banyan-tokenize")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._byte_map: dict[str, int] | None = None
        if backend is not None:
            from tokenizers import decoders

            if isinstance(backend.decoder, decoders.ByteLevel):
                self._byte_map = unicode_to_bytes()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._names: dict[int, tuple[str, list[int]]] = {}  # token id -> (text, bytes)

    # ---- off the event loop -----------------------------------------------------------------

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the pool; TokenizeTimeout past the time limit (time queued included)."""
        deadline = time.monotonic() + self.timeout
        future = asyncio.get_running_loop().run_in_executor(
            self._pool, _with_deadline, deadline, self.timeout, fn, *args)
        try:
            return await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise TokenizeTimeout(_timeout_message(self.timeout)) from None

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop(self.encode, text, add_special_tokens)

    async def chat_ids_async(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                             continue_final_message: bool = False,
                             template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation rendered and tokenized, in one trip to the pool."""
        def render() -> list[int]:
            return self.encode_chat(self.chat_prompt(messages, add_generation_prompt,
                                                     continue_final_message, template_kwargs))
        return await self.off_loop(render)

    async def bad_words_ids_async(self, words: Sequence[str]) -> list[list[int]]:
        return await self.off_loop(self.bad_words_ids, words)

    async def decode_async(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self.off_loop(self.decode, ids, skip_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- prompts ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation rendered by the model's chat template; ValueError when there is
        no template or it rejects the conversation."""
        if getattr(self.tokenizer, "chat_template", None) is None and \
                not (template_kwargs or {}).get("chat_template"):
            raise ValueError("this model has no chat template; use /v1/completions")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # continuing the last message adds no new turn
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        except TokenizeTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja raises many types
            raise ValueError(f"the chat template could not render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError("the chat template did not produce text")
        return text

    def bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences (SamplingParams.bad_words_ids): each word as it
        is (leading spaces dropped), and after a space too where that starts with another
        token and has as many (the word inside a text); ValueError for a word of no tokens."""
        out: list[list[int]] = []
        for word in words:
            alone = self.encode(word.lstrip(), add_special_tokens=False)
            if not alone:
                raise ValueError(f"bad word {word!r} has no tokens")
            out.append(alone)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

    def encode_chat(self, text: str) -> list[int]:
        # The template already wrote the special tokens (BOS, role markers): add none.
        return self.encode(text, add_special_tokens=False)

    def check_ids(self, ids: Sequence[int]) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- single tokens ----------------------------------------------------------------------

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token. The text is the token decoded alone (U+FFFD where it
        holds part of a character); the bytes are exact for byte-level and byte-fallback
        vocabularies."""
        named = self._names.get(token_id)
        if named is None:
            named = self._name(token_id)
            self._names[token_id] = named
        return named

    def token_text(self, token_id: int) -> str:
        return self.token(token_id)[0]

    def _name(self, token_id: int) -> tuple[str, list[int]]:
        if not 0 <= token_id < self.vocab_size:
            return "", []
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id not in self._special and isinstance(raw, str):
            if self._byte_map is not None and all(ch in self._byte_map for ch in raw):
                return text, [self._byte_map[ch] for ch in raw]
            if len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
                try:
                    return text, [int(raw[3:5], 16)]  # SentencePiece byte fallback
                except ValueError:
                    pass
        return text, list(text.encode("utf-8"))
