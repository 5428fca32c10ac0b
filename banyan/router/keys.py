"""What the router remembers of a request: its routing key, a string whose prefixes stand for the
prompt prefixes a worker's KV cache would hold after serving it.

The router does not tokenize (it has no tokenizer, and should stay cheap), so the key is:
- token-id prompts (/v1/completions `prompt: [ids]`, /generate `input_ids`): one character per
  token id (`chr(id)`), so the tree compares whole tokens with C-speed string operations;
- text prompts (/v1/completions `prompt: "..."`, /generate `text`): the text itself, one symbol
  per character (a text prefix is close to a token prefix: both grow together);
- chat (/v1/chat/completions): the messages rendered as `role \\x1f content \\x1e` each, in order
  (not the model's chat template, which only the worker has: the rendering only needs the same
  conversation prefix to give the same key prefix, which it does).
A batch of prompts is keyed by its first prompt. Text, token and chat keys live in separate
namespaces (a text prompt and the same prompt as ids would not share a worker's cache entries
anyway), and so does each `cache_salt`, which the worker uses to keep tenants' caches apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MAX_CHAR = 0x110000


@dataclass(slots=True, frozen=True)
class RouteKey:
    namespace: str  # "ids" | "text" | "chat", then "\x00" + cache_salt when one is given
    text: str

    def __len__(self) -> int:
        return len(self.text)


def ids_to_text(ids: list[Any]) -> str | None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    try:
        return "".join(map(chr, ids))
    except ValueError:  # an id past the Unicode range (or negative): fold it, the key is a hint
        return "".join(chr(t % _MAX_CHAR) for t in ids)


def _prompt_key(prompt: Any) -> tuple[str, str] | None:
    """A prompt field (str, [ids], [str], [[ids]]) -> (kind, key text) of its first prompt."""
    if isinstance(prompt, str):
        return "text", prompt
    if not isinstance(prompt, list) or not prompt:
        return None
    first = prompt[0]
    if isinstance(first, str):
        return "text", first
    if isinstance(first, list):
        text = ids_to_text(first)
        return None if text is None else ("ids", text)
    text = ids_to_text(prompt)
    return None if text is None else ("ids", text)


def _chat_text(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, in order
            content = "".join(t for p in content if isinstance(p, dict)
                              and isinstance(t := p.get("text"), str))
        parts.append(f"{m.get('role', '')}\x1f{content if isinstance(content, str) else ''}\x1e")
    return "".join(parts)


def route_key(path: str, body: Any) -> RouteKey | None:
    """The key of a parsed request body on `path`, or None when it has no prompt to key on (the
    worker will judge the request; the router sends it to the least-loaded worker)."""
    if not isinstance(body, dict):
        return None
    kind_text: tuple[str, str] | None
    if path.endswith("/chat/completions"):
        text = _chat_text(body.get("messages"))
        kind_text = None if text is None else ("chat", text)
    elif path.endswith("/completions"):
        kind_text = _prompt_key(body.get("prompt"))
    elif path.endswith("/generate"):
        kind_text = _prompt_key(body["text"] if body.get("text") is not None
                                else body.get("input_ids"))
    else:
        kind_text = None
    if kind_text is None or not kind_text[1]:
        return None
    kind, text = kind_text
    salt = body.get("cache_salt")
    namespace = f"{kind}\x00{salt}" if isinstance(salt, str) and salt else kind
    return RouteKey(namespace, text)
