"""Streaming text for byte-level BPE tokenizers (GPT-2's byte map: Llama 3, Qwen2/3, SmolLM2)
without calling the tokenizer per token.

Their decoder turns each token into a fixed byte string and the concatenation into text
(invalid UTF-8 replaced by U+FFFD, one per maximal invalid run). So a request's text can be
streamed from a table of every token's bytes and Python's incremental UTF-8 decoder, which holds
back an unfinished character and replaces invalid bytes exactly as that one-shot decode does:
one table lookup and one C call per token, where `IncrementalDetokenizer` makes two tokenizer
decodes of a window (~2-5 us each: most of a decode step's output work at 256 running requests).

`TokenBytes.of` builds the table when the tokenizer's decoder is byte-level alone, and checks it
against the tokenizer's own decodes of sample sequences; any other decoder (SentencePiece's
Metaspace with byte fallback, WordPiece) keeps the window decoder.
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

# Prompt tokens fed to the decoder before the output: enough bytes to finish or invalidate a
# character the prompt ends inside (4 bytes at most, at least one per token).
PROMPT_BYTES_CONTEXT = 4
SELF_CHECK_SEQUENCES = 64


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE writes each byte as one printable
    character; this maps them back, so a token's exact bytes are known even when they are
    half of a UTF-8 character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=1)
def _to_byte_chars() -> dict[int, str]:
    """str.translate table from the stand-in characters to the bytes they stand for (as latin-1
    characters); other characters below 256 go to U+FFFF, which latin-1 cannot encode, so a
    token holding one is seen as outside the map."""
    table = {c: "\uffff" for c in range(256)}
    table.update({ord(ch): chr(b) for ch, b in unicode_to_bytes().items()})
    return table


class TokenBytes:
    """Every token's bytes as the tokenizer's byte-level decoder produces them, and which
    tokens `skip_special_tokens` drops."""

    __slots__ = ("table", "special", "texts")

    def __init__(self, table: list[bytes], special: frozenset[int]) -> None:
        self.table = table
        self.special = special
        # Each token's text where its bytes are whole UTF-8 characters (most tokens), else None:
        # after a character boundary such a token's text is known without a decoder call.
        self.texts: list[str | None] = [_whole_text(b) for b in table]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenBytes | None:
        """The table of a tokenizer whose decoder is byte-level alone, checked against its own
        decodes; None for any other tokenizer."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
            return None  # another decoder, or a slow (Python) tokenizer
        to_bytes = _to_byte_chars()
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            try:
                table[token_id] = token.translate(to_bytes).encode("latin-1")
            except UnicodeEncodeError:  # the decoder's rule: a character outside the map
                table[token_id] = token.encode()  # sends the whole token out as UTF-8
        added = backend.get_added_tokens_decoder()
        made = cls(table, frozenset(i for i, token in added.items() if token.special))
        return made if made._agrees_with(backend, sorted(added)) else None

    def _agrees_with(self, backend: Any, added: list[int]) -> bool:
        """Random sequences, and every added token (special or not) between random ones,
        decode alike."""
        rng = random.Random(0)
        n = len(self.table)
        samples = [[rng.randrange(n) for _ in range(rng.randrange(1, 12))]
                   for _ in range(SELF_CHECK_SEQUENCES)]
        samples += [[rng.randrange(n), t, rng.randrange(n)] for t in added]
        for skip in (True, False):
            want = backend.decode_batch(samples, skip_special_tokens=skip)
            got = [self.decode(s, skip) for s in samples]
            if got != want:
                return False
        return True

    def bytes_of(self, ids: Sequence[int], skip_special_tokens: bool) -> bytes:
        table, n = self.table, len(self.table)
        skip = self.special if skip_special_tokens else frozenset()
        return b"".join(table[t] for t in ids if 0 <= t < n and t not in skip)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.bytes_of(ids, skip_special_tokens).decode("utf-8", "replace")


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ByteDetokenizer:
    """`IncrementalDetokenizer`'s interface over a TokenBytes table: push a token, get the text
    it completes; finish() flushes an unfinished character as U+FFFD."""

    __slots__ = ("_table", "_texts", "_size", "_skip", "_held", "_prompt_open")

    def __init__(self, token_bytes: TokenBytes, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._table = token_bytes.table
        self._texts = token_bytes.texts
        self._size = len(self._table)
        self._skip = token_bytes.special if skip_special_tokens else frozenset()
        # Python's incremental UTF-8 decoder, unrolled (codecs' BufferedIncrementalDecoder is
        # this in Python): the bytes of an unfinished character are held until the next token.
        # The prompt's last bytes are decoded and dropped: an output that finishes a character
        # the prompt began emits that character, as a decode of prompt + output shows it.
        prompt = token_bytes.bytes_of(prompt_ids[-PROMPT_BYTES_CONTEXT:], skip_special_tokens)
        self._held = prompt[codecs.utf_8_decode(prompt, "replace", False)[1]:]
        # The prompt ends inside a character: its text shows a U+FFFD for it already, so when
        # the output breaks that character instead, its U+FFFD is not the output's.
        self._prompt_open = bool(self._held)

    def push(self, token_id: int) -> str:
        if token_id in self._skip or not 0 <= token_id < self._size:
            return ""
        if not self._held:  # at a character boundary (then the prompt's is closed too)
            whole = self._texts[token_id]
            if whole is not None:
                return whole
        data = self._held + self._table[token_id]
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        if self._prompt_open and text:
            self._prompt_open = False
            if text[0] == "\ufffd":
                text = text[1:]
        return text

    def finish(self) -> str:
        text = codecs.utf_8_decode(self._held, "replace", True)[0]
        self._held = b""
        if self._prompt_open and text:  # the output never touched the prompt's open character
            text = text[1:]
        self._prompt_open = False
        return text


class ByteTextStream(ByteDetokenizer):
    """A request's text stream (what the scheduler calls of TextAccumulator: push_text, finish)
    for a byte-level tokenizer and no stop strings, in one object: nothing is held back for a
    stop string, so the text is the detokenizer's. Pushed once per generated token: one object
    where TextAccumulator takes three. Keeps no copy of the text: the engine's callers assemble
    it from the updates."""

    __slots__ = ()

    stopped = False  # no stop strings

    def push_text(self, token_id: int) -> tuple[str, bool]:
        return self.push(token_id), False

    @staticmethod
    def push_many(streams: Sequence[ByteTextStream], tokens: Sequence[int]) -> list[str]:
        """`push` of one token on each stream, a step's streams at once (the scheduler's
        decode lane, scheduler/request.py's TextStream): the usual token, whole characters at a
        character boundary, is looked up here (push's first lines, inlined: a call or two per
        stream is what this saves, ~1 us a request in a busy loop); the rest goes through push."""
        out: list[str] = []
        append = out.append
        for stream, token in zip(streams, tokens, strict=True):
            if not stream._held and token not in stream._skip and 0 <= token < stream._size:
                whole = stream._texts[token]
                if whole is not None:
                    append(whole)
                    continue
            append(stream.push(token))
        return out
