"""Structured output and tool calling through unmodified clients (openai, langchain-openai,
litellm) against a real `banyan serve` subprocess with the tiny random llama. The model's own
output is noise: every parse below succeeds only because the grammar held it to the schema.
Fields are bounded (maxLength, ranges) so a random model finishes them within max_tokens."""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.server_helpers import ServerProcess, running_server
from tests.http_client import HTTP


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the weather in a city."""

    city: str = Field(max_length=6)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": GetWeather.model_json_schema()}}


def _import_clients() -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    for name in ("langchain_openai", "litellm"):  # seconds each: overlapped with server start
        importlib.import_module(name)


@pytest.fixture(scope="module")
def client_imports() -> Iterator[threading.Thread]:
    thread = threading.Thread(target=_import_clients, daemon=True)
    thread.start()
    yield thread
    thread.join()


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           client_imports: threading.Thread) -> Iterator[ServerProcess]:
    with running_server(llama_dir, tmp_path_factory.mktemp("structured"),
                        "--overlap", "on", "--shutdown-timeout", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return server.openai()


def test_openai_parse_with_a_pydantic_model(client: OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "who?"}], response_format=Person,
            max_tokens=120, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person)


def test_openai_tools_required_and_named_streamed(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=120, n=2, temperature=1.0, seed=1)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        GetWeather.model_validate_json(call.function.arguments)
    with client.chat.completions.stream(
            model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=120) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls
    GetWeather.model_validate_json(call.function.arguments)
    # tool_choice none: no grammar, no parsing; the reply is plain content
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
        tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None


def test_vllm_and_sglang_fields_on_every_endpoint(server: ServerProcess,
                                                  client: OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="x", max_tokens=10,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]"}})
    assert len(r.choices[0].text) == 5 and r.choices[0].text[3] == "-"
    # Any object: keys and strings are free text, which a random model rarely closes; a bias
    # toward '"' and '}' (the grammar still decides what is allowed) makes it end soon.
    closing = HTTP.post(f"{server.url}/tokenize", json={"prompt": '"}',
                                                          "add_special_tokens": False}).json()
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=120,
        response_format={"type": "json_object"}, temperature=1.0, seed=4,
        logit_bias={str(t): 8 for t in closing["tokens"]})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object",
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    out = HTTP.post(f"{server.url}/generate", timeout=60, json={
        "text": "x", "sampling_params": {"max_new_tokens": 30, "json_schema": json.dumps(schema)}})
    jsonschema.validate(json.loads(out.json()["text"]), schema)


def test_unenforceable_schema_is_a_400_naming_it(server: ServerProcess) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
    r = HTTP.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": bad})
    assert r.status_code == 400
    assert "uniqueItems" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"
    r = HTTP.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_langchain_structured_output_and_bind_tools(server: ServerProcess,
                                                    client_imports: threading.Thread) -> None:
    client_imports.join()
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="tiny",
                     max_tokens=120, max_retries=0, temperature=1.0, seed=5)
    person = llm.with_structured_output(Person).invoke("who?")
    assert isinstance(person, Person)
    person = llm.with_structured_output(Person, method="function_calling").invoke("who?")
    assert isinstance(person, Person)
    message = llm.bind_tools([GetWeather], tool_choice="required").invoke("weather?")
    assert [c["name"] for c in message.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(message.tool_calls[0]["args"])


def test_litellm_openai_compatible_provider(server: ServerProcess,
                                            client_imports: threading.Thread) -> None:
    client_imports.join()
    import litellm

    common = dict(model="openai/tiny", api_base=f"{server.url}/v1", api_key="unused",
                  max_tokens=120, temperature=1.0, seed=6)
    r = litellm.completion(messages=[{"role": "user", "content": "who?"}],
                           response_format=Person, **common)
    Person.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(messages=[{"role": "user", "content": "weather?"}],
                           tools=[WEATHER_TOOL], tool_choice="required", **common)
    assert r.choices[0].finish_reason == "tool_calls"
    GetWeather.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)
