"""vLLM's sampling and response extras through a real `banyan serve` (the tiny llama):
allowed_token_ids, truncate_prompt_tokens, bad_words, return_token_ids and
return_tokens_as_token_ids (docs/api.md). include_stop_str_in_output and
continuous_usage_stats ride on tests/test_server.py's stop-string and usage tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.http_client import HTTP
from tests.server_helpers import ServerProcess, running_server, sse_events


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(llama_dir, tmp_path_factory.mktemp("server-extras")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return server.openai()


PROMPT = "def main(): print('café 東京')"  # (tests/test_server.py's)
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_allowed_token_ids_and_truncated_prompts(client: OpenAI) -> None:
    """vLLM's allowed_token_ids (here one token: it must be every token generated) and
    truncate_prompt_tokens (the prompt's last k tokens: what usage counts and echo shows)."""
    base = str(client.base_url)
    ids = HTTP.post(base.replace("/v1/", "/tokenize"),
                    json={"prompt": PROMPT}).json()["tokens"]
    forced = ids[len(ids) // 2]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0,
                                    extra_body={"ignore_eos": True,
                                                "allowed_token_ids": [forced]})
    want = HTTP.post(base.replace("/v1/", "/detokenize"), json={"tokens": [forced] * 3})
    assert out.choices[0].text == want.json()["prompt"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
        temperature=0.0, extra_body={"ignore_eos": True, "allowed_token_ids": [forced]})
    assert chat.choices[0].message.content == want.json()["prompt"]
    cut = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 3}}
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=4, echo=True, **cut)
    alone = client.completions.create(model="tiny", prompt=ids[-3:], max_tokens=4, echo=True,
                                      **GREEDY)
    assert out.usage.prompt_tokens == 3 and out.choices[0].text == alone.choices[0].text
    cut["extra_body"]["truncate_prompt_tokens"] = -1
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, **cut)
    assert out.usage.prompt_tokens == len(ids)  # (shorter than the context: as it was)
    r = HTTP.post(base + "completions", json={"prompt": "a", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    # -1 on a prompt past the context: as many tokens as leave max_tokens room
    info = HTTP.get(base.replace("/v1/", "/server_info")).json()
    room = min(info["max_model_len"], info["kv_capacity"]) - 4
    out = client.completions.create(model="tiny", prompt=(ids * 999)[:room + 50], max_tokens=4,
                                    **cut)
    assert out.usage.prompt_tokens == room and out.usage.completion_tokens == 4
    r = HTTP.post(base + "completions", json={  # (completions' default max_tokens: 16)
        "prompt": (ids * 999)[:room + 50], "temperature": 0.0, "truncate_prompt_tokens": -1,
        "ignore_eos": True})
    assert r.json()["usage"]["prompt_tokens"] == room + 4 - 16, r.text
    r = HTTP.post(base + "completions", json={"prompt": "a", "max_tokens": 10**6,
                                              "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = HTTP.post(base + "completions", json={"prompt": "a", "allowed_token_ids": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
        temperature=0.0, extra_body={"truncate_prompt_tokens": 2})
    assert chat.usage.prompt_tokens == 2
    # an allowed token that ends the request, while min_tokens forbids ending: refused
    r = HTTP.post(base + "completions", json={"prompt": "a", "min_tokens": 2,
                                              "stop_token_ids": [5], "allowed_token_ids": [5]})
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"]
    r = HTTP.post(base + "completions", json={"prompt": "a", "n": 2, "best_of": 2,
                                              "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_return_token_ids(server: ServerProcess) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's beside the text, whole and
    streamed (the prompt's once, with a choice's first chunk; then each chunk's new ids)."""
    url = f"{server.url}/v1"
    ids = HTTP.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "return_token_ids": True, "logprobs": 0}
    whole = whole_completion = HTTP.post(f"{url}/completions", json=body).json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 6
        detok = HTTP.post(f"{server.url}/detokenize", json={"tokens": c["token_ids"]}).json()
        assert detok["prompt"] == c["text"]
    with HTTP.stream("POST", f"{url}/completions", json={**body, "stream": True}) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == whole["choices"][i]["token_ids"]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = HTTP.post(f"{url}/chat/completions", json=chat).json()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert len(whole["choices"][0]["token_ids"]) == 5
    with HTTP.stream("POST", f"{url}/chat/completions", json={**chat, "stream": True}) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == \
        whole["choices"][0]["token_ids"]
    # return_tokens_as_token_ids: logprobs name every token "token_id:N"
    echoed = {**body, "logprobs": 2, "echo": True}
    texts = HTTP.post(f"{url}/completions", json=echoed).json()
    named = HTTP.post(f"{url}/completions",
                      json={**echoed, "return_tokens_as_token_ids": True}).json()
    for c, before, text in zip(named["choices"], whole_completion["choices"], texts["choices"],
                               strict=True):
        logprobs = c["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in ids + before["token_ids"]]
        assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"][1:]
                   for k in top)
        assert logprobs["text_offset"] == text["logprobs"]["text_offset"]  # the text's
    named = HTTP.post(f"{url}/chat/completions", json={
        **chat, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True})
    content = named.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == \
        [f"token_id:{t}" for t in whole["choices"][0]["token_ids"]]
    assert all(a["token"].startswith("token_id:") and a["bytes"] == list(a["token"].encode())
               for e in content for a in e["top_logprobs"])
    plain = HTTP.post(f"{url}/chat/completions", json={**chat, "return_token_ids": None})
    assert "prompt_token_ids" not in plain.json()
    assert "token_ids" not in plain.json()["choices"][0]


def test_bad_words(client: OpenAI) -> None:
    """vLLM's bad_words: a word the greedy text has (one token, after a space) never comes
    out again, through completions and chat alike."""
    def tokens(**extra: object) -> list[str]:
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, logprobs=0,
                                        temperature=0.0,
                                        extra_body={"ignore_eos": True, **extra})
        return out.choices[0].logprobs.tokens
    def ids(text: str) -> list[int]:
        return HTTP.post(str(client.base_url).replace("/v1/", "/tokenize"), json={
            "prompt": text, "add_special_tokens": False}).json()["tokens"]

    def one_token_word(text: str) -> bool:  # a token the word's own sequences ban
        alone, spaced = ids(text.lstrip()), ids(" " + text.lstrip())
        if len(alone) != 1 or not text.strip():
            return False
        return text == text.lstrip() or (len(spaced) == 1 and spaced != alone)
    base = tokens()
    word = next(t for t in base if one_token_word(t))
    banned = tokens(bad_words=[word])
    cut = base.index(word)
    assert word not in banned and banned[:cut] == base[:cut]
    for words in (["  "], ["w"] * 1001):  # a word of no tokens; past the limit
        r = HTTP.post(str(client.base_url) + "completions",
                      json={"prompt": "a", "bad_words": words})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
