"""Structured output in the engine: spec checks, the tool-call parser, per-position masks for
proposals, and constrained generation on the tiny random llama (whose free output is noise, so
every valid JSON here is the grammar's doing) with overlap, retraction, chunked prefill, n > 1
and abort."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import jsonschema
import pytest
import torch

from banyan.engine.offline import Engine
from banyan.sampling.params import SamplingParams
from banyan.structured.grammar import GrammarBackend
from banyan.structured.masks import TokenMasks
from banyan.structured.request_fields import spec_from_fields
from banyan.structured.spec import StructuredSpec, json_schema_spec
from banyan.structured.tools import ToolCallStream, parse_tool_calls, tool_call_grammar

TINY_KV_BYTES_PER_TOKEN = 512  # 2 layers x 2 kv heads x 16 dims x (K, V) x 4 bytes

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("fields, message", [
    ({"guided_json": {"type": "array", "uniqueItems": True}},
     "guided_json: JSON schema keyword 'uniqueItems'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}}}},
     "response_format.json_schema.schema: JSON schema keyword 'multipleOf' "
     "(at /properties/n/multipleOf)"),
    ({"guided_json": {"type": "string", "format": "credit-card"}}, "format 'credit-card'"),
    ({"guided_json": {"type": "string", "pattern": "^a+$", "maxLength": 3}},
     "'maxLength' together with 'pattern'"),
    ({"guided_regex": "("}, "guided_regex: Regex parsing error"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar:"),
    ({"guided_choice": []}, "guided_choice: a non-empty list"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural tags are not supported"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "only one structured output"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "give one of"),
])
def test_unenforceable_or_bad_specs_are_refused_naming_the_field(fields, message) -> None:
    with pytest.raises(ValueError, match=None) as err:
        spec_from_fields(fields)
    assert message in str(err.value)


def test_specs_from_every_field_name() -> None:
    assert spec_from_fields({"response_format": {"type": "text"}}) is None
    assert spec_from_fields({"response_format": {"type": "json_object"}}).kind == "json_object"
    assert spec_from_fields({"structured_outputs": {"choice": ["x", "y"]}}).kind == "choice"
    assert spec_from_fields({"ebnf": 'root ::= "a"'}).kind == "grammar"
    assert spec_from_fields({"json_schema": json.dumps(SCHEMA)}).kind == "json"


def test_tool_call_stream_split_anywhere_gives_the_same_calls() -> None:
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> <tool_call>{"no'
    for cut in range(len(text) + 1):
        stream = ToolCallStream()
        deltas = stream.feed(text[:cut]) + stream.feed(text[cut:], final=True)
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] \
            == [(0, "f", '{"x": 1}')]
        content = "".join(d.get("content", "") for d in deltas)
        assert content == 'Sure.  <tool_call>{"no'  # the unclosed, unparsable block stays text
    assert parse_tool_calls("plain") == ("plain", [])


def test_mask_per_proposed_position_matches_advancing(llama_dir: Path) -> None:
    """Speculative decoding's hook: the mask at proposal j equals the mask after accepting the
    first j proposals, and filling takes nothing back from the matcher."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    compiled = backend.submit(json_schema_spec(SCHEMA, "x")).result(timeout=60)
    proposed = tok.encode('{"name": "ab', add_special_tokens=False)
    state = backend.new_state(compiled)
    words = (len(tok) + 31) // 32
    together = torch.zeros(len(proposed) + 1, words, dtype=torch.int32)
    state.fill(together, 0, proposed)
    assert state.accepted == 0
    step_by_step = backend.new_state(compiled)
    for j in range(len(proposed) + 1):
        one = torch.zeros(1, words, dtype=torch.int32)
        step_by_step.fill(one, 0, [])
        assert torch.equal(one[0], together[j]), f"position {j}"
        if j < len(proposed):
            step_by_step.advance([proposed[j]])
    logits = torch.zeros(1, len(tok))
    TokenMasks(together[:1], [0]).apply(logits)
    assert torch.isfinite(logits).sum() == 1  # only "{" may start the object
    backend.close()


def _check_outputs(outs, schema) -> None:
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample
            jsonschema.validate(json.loads(sample.text), schema)


SETTINGS = {  # plain overlap: test_same_seed_same_output_with_and_without_overlap
    "retraction": dict(overlap="on", kv_cache_memory=str(160 * TINY_KV_BYTES_PER_TOKEN),
                       max_prefill_tokens=64, chunked_prefill_size=16),
    "chunked": dict(overlap="off", max_prefill_tokens=16, chunked_prefill_size=7),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_constrained_generation_is_valid(llama_dir: Path, setting: str) -> None:
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                **SETTINGS[setting]) as engine:
        engine.core.scheduler.config.check_integrity = True
        spec = json_schema_spec(SCHEMA, "x")
        count = 6 if setting == "retraction" else 3  # enough to run out of KV there
        prompts = ["a longer prompt than one chunk of seven tokens, to be split"] * count
        params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=10 * i, n=2,
                                 structured=spec) for i in range(count)]
        outs = engine.generate(prompts, params)
        _check_outputs(outs, SCHEMA)
        if setting == "retraction":
            assert engine.core.scheduler.total_retractions > 0
        choice = SamplingParams(max_new_tokens=20, temperature=0,
                                structured=StructuredSpec("choice", '["left", "right"]'))
        assert engine.generate(["x"], choice)[0].text in ("left", "right")


def test_same_seed_same_output_with_and_without_overlap(llama_dir: Path) -> None:
    texts = []
    for overlap in ("on", "off"):
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    overlap=overlap) as engine:
            params = SamplingParams(max_new_tokens=80, temperature=1.0, seed=7,
                                    structured=json_schema_spec(SCHEMA, "x"))
            outs = engine.generate(["q"] * 3, params)
            _check_outputs(outs, SCHEMA)
            texts.append([o.text for o in outs])
    assert texts[0] == texts[1]


def test_speculation_under_a_grammar_changes_nothing(llama_dir: Path) -> None:
    """ngram guesses under a grammar: each guessed position gets its own mask, the matcher
    advances only by accepted tokens, so the seeded outputs equal the unspeculated ones."""
    example = '{"name": "ab", "age": 3, "tags": ["a"], "ok": true}'
    prompt = f"{example} {example} {example}"  # the lookup finds the JSON it is writing
    texts = []
    for algo in ("none", "ngram"):
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    overlap="off", speculative_algorithm=algo) as engine:
            params = [SamplingParams(max_new_tokens=80, temperature=t, seed=3,
                                     structured=json_schema_spec(SCHEMA, "x"))
                      for t in (0.0, 1.0, 1.0)]
            outs = engine.generate([prompt] * 3, params)
            _check_outputs(outs, SCHEMA)
            texts.append([o.text for o in outs])
            if algo == "ngram":
                stats = engine.core.scheduler.speculation.stats
                assert stats.num_accepted_tokens > 0  # guesses were checked under masks
    assert texts[0] == texts[1]


def test_abort_frees_the_matcher_and_forced_tool_call(llama_dir: Path) -> None:
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True) as engine:
        spec = json_schema_spec(SCHEMA, "x")
        engine.add_request("p", SamplingParams(max_new_tokens=200, structured=spec),
                           request_id="r")
        while engine.core.is_waiting("r") and engine.core.has_work:
            engine.step()  # compiled and admitted
        grammar = weakref.ref(engine.core.scheduler.requests["r"].grammar)
        engine.step()
        engine.abort("r")
        while engine.core.has_work:
            engine.step()
        gc.collect()
        assert grammar() is None
        tools = [{"type": "function", "function": {"name": "get", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"]}}}]
        out = engine.generate(["x"], SamplingParams(max_new_tokens=80, temperature=1.0, seed=1,
                                                    structured=tool_call_grammar(tools)))[0]
        content, calls = parse_tool_calls(out.text)
        assert content.strip() == "" and [c.name for c in calls] == ["get"]
        assert len(json.loads(calls[0].arguments)["city"]) <= 5


def test_validity_workload_all_valid(llama_dir: Path) -> None:
    """The benchmark's 20 schemas (benchmarks/structured_validity.py runs 1,000), once each."""
    from banyan.structured.validity import SCHEMAS, run

    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                overlap="on") as engine:
        report = run(engine, per_schema=1, seed=123)
    assert report.generations == len(SCHEMAS) == 20
    assert report.valid == report.generations, report.failures


def test_mask_kernel_and_torch_fallback_agree_on_a_subset_of_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 16), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, 500, generator=gen)
    kernel, fallback = logits.clone(), logits.clone()
    TokenMasks(bitmask, [0, 2, 4]).apply(kernel)
    TokenMasks(bitmask, [0, 2, 4])._apply_torch(fallback)
    assert torch.equal(kernel, fallback)
    assert torch.equal(kernel[1], logits[1]) and torch.isinf(kernel[0]).any()


class _NeverCompiles:
    """A backend whose compile never finishes (a pathological grammar)."""

    def submit(self, spec: StructuredSpec):
        from concurrent.futures import Future

        return Future()


def test_grammar_wait_times_out_or_is_aborted_without_blocking() -> None:
    from banyan.scheduler.request import Request
    from banyan.structured.waiting import GrammarWaitlist

    waitlist = GrammarWaitlist(_NeverCompiles(), timeout_s=0.05)  # type: ignore[arg-type]
    spec = StructuredSpec("regex", "a+")
    waitlist.add(spec, [Request("slow", [1], SamplingParams(), 4)])
    waitlist.add(spec, [Request("gone#0", [1], SamplingParams(), 4),
                        Request("gone#1", [1], SamplingParams(), 4)])
    assert waitlist.remove("gone#0").rid == "gone#0" and waitlist.rids() == ["slow", "gone#1"]
    assert waitlist.collect() == ([], [])  # not ready, not late: nothing yet, at once
    ready, failed = waitlist.collect(block_s=0.1)
    assert ready == [] and sorted(r.rid for r, _ in failed) == ["gone#1", "slow"]
    assert "--grammar-compile-timeout" in failed[0][1] and len(waitlist) == 0


def test_tools_reach_the_template_or_a_system_prompt() -> None:
    from banyan.server.structured_api import ChatTools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = ChatTools.from_body(tools, "auto", "hermes")
    assert chat is not None and chat.forced is None
    messages = [{"role": "user", "content": "hi"}]
    same, kwargs = chat.render(messages, "{% for t in tools %}{{ t }}{% endfor %}", None)
    assert same == messages and kwargs["tools"] == tools
    added, kwargs = chat.render(messages, "{{ messages }}", {"x": 1})
    assert (kwargs == {"x": 1} and added[0]["role"] == "system"
            and '"name": "f"' in added[0]["content"])
    assert ChatTools.from_body(tools, "none", "hermes") is None
    message, finish = ChatTools.message(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
