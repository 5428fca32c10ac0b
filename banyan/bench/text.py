"""Text prompts of exact token lengths, for endpoints that take text (chat, or completions with
--prompt-format text).

Random token ids do not survive a decode/encode round trip (merges across token boundaries,
partial UTF-8 characters), so the text is not the decoded ids. Instead every id is mapped, by a
fixed rule (id modulo the word list), to a "word token": a token that decodes to a space plus
ASCII letters and encodes back to itself alone. A byte-level BPE pre-tokenizer splits text at
such space-led words and merges never cross that split, so the text of n mapped ids encodes
to exactly those n ids; equal id prefixes give equal text prefixes, so the workload's prefix
sharing survives. `TextPrompts.check` confirms it on a sample; for tokenizers where it does not
hold (no such words, SentencePiece-style prefixes), `exact_text` trims or pads with a word until
the length is right, and the prompt token count the benchmark reports is always the tokenizer's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_WORD = re.compile(r"^ [A-Za-z]{2,12}$")


class TextPrompts:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.words = self._word_tokens()
        if not self.words:
            raise ValueError("the tokenizer has no ' word' tokens to build text prompts from")
        self._filler = self.words[0]

    def _word_tokens(self) -> list[int]:
        tok = self.tokenizer
        special = set(getattr(tok, "all_special_ids", []) or [])
        words = []
        for tid in range(getattr(tok, "vocab_size", 0) or len(tok)):
            if tid in special:
                continue
            text = tok.decode([tid])
            if _WORD.match(text) and self.encode(text) == [tid]:
                words.append(tid)
        return words

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def mapped(self, ids: Sequence[int]) -> list[int]:
        return [self.words[t % len(self.words)] for t in ids]

    def text(self, ids: Sequence[int]) -> str:
        """Text that encodes (without special tokens) to exactly len(ids) tokens."""
        return self.exact_text(self.mapped(ids))

    def exact_text(self, ids: Sequence[int]) -> str:
        target = len(ids)
        text = self.tokenizer.decode(list(ids))
        for _ in range(64):
            got = self.encode(text)
            if len(got) == target:
                return text
            if len(got) > target:
                text = self.tokenizer.decode(got[:target])
            else:
                text += self.tokenizer.decode([self._filler] * (target - len(got)))
        raise ValueError(f"could not build a text of exactly {target} tokens")

    def check(self, sample: int = 256) -> bool:
        """True when mapped ids round-trip exactly (the text is the ids, token for token)."""
        ids = self.mapped(range(sample))
        return self.encode(self.tokenizer.decode(ids)) == ids


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's tokens as the server sees them: the chat template with the
    generation prompt, encoded without adding special tokens (the template writes them)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
