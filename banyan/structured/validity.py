"""The structured-output validity workload: 20 JSON schemas covering what the grammar enforces
(bounded strings and numbers, enums, const, anyOf, $ref, nested objects and arrays, optional
properties, patterns, formats), generated with sampling and checked with `jsonschema`.

Strings carry maxLength and integers ranges: a random-weight model picks any allowed token, so
an unbounded string would close only by chance (a real model closes it); the grammar is what
is under test, not the model's taste. Used by benchmarks/structured_validity.py (1,000
generations) and its small test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

S = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": -50, "maximum": 5000}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "why": S},
     "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}, "n": INT},
     "required": ["v", "n"]},
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"pt": {"type": "object", "properties": {"x": INT, "y": INT},
                                             "required": ["x", "y"]}}, "required": ["pt"]},
    {"type": "object", "properties": {"id": {"anyOf": [INT, {"type": "null"}]}},
     "required": ["id"]},
    {"type": "object", "properties": {"when": {"type": "string", "pattern":
        "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])$"}}, "required": ["when"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"$defs": {"item": {"type": "object", "properties": {"k": S, "q": INT},
                        "required": ["k", "q"]}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                "maxItems": 3}}, "required": ["items"]},
    {"type": "object", "properties": {"a": S, "b": INT, "c": {"type": "boolean"}},
     "required": ["a"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [S, INT],
                                               "items": False}}, "required": ["pair"]},
    {"type": "object", "properties": {"nothing": {"type": "null"}, "flag": {"type": "boolean"}},
     "required": ["nothing", "flag"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]},
                             "maxItems": 2}}, "required": ["name", "roles"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5}},
     "required": ["ids"]},
    {"type": "object", "properties": {"uid": {"type": "string", "format": "uuid"}},
     "required": ["uid"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
     "required": ["word"]},
    {"type": "object", "properties": {"value": {"anyOf": [S, {"type": "boolean"},
                                                          {"enum": [1, 2, 3]}]}},
     "required": ["value"]},
]


@dataclass(slots=True)
class ValidityReport:
    generations: int = 0
    valid: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first few, for a look

    @property
    def valid_percent(self) -> float:
        return 100.0 * self.valid / max(self.generations, 1)


def check(schema: dict[str, Any], text: str, finish_reason: str | None,
          report: ValidityReport) -> None:
    import jsonschema

    report.generations += 1
    key = finish_reason or "none"
    report.finish_reasons[key] = report.finish_reasons.get(key, 0) + 1
    try:
        jsonschema.validate(json.loads(text), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        report.valid += 1
    except (ValueError, jsonschema.ValidationError) as exc:
        if len(report.failures) < 10:
            report.failures.append({"schema": SCHEMAS.index(schema), "text": text[:300],
                                    "finish_reason": finish_reason,
                                    "error": str(exc).splitlines()[0][:200]})


def run(engine: Any, per_schema: int, max_new_tokens: int = 256,
        seed: int = 0) -> ValidityReport:
    """per_schema sampled generations (temperature 1, seeded) for each schema, all queued at
    once; each output parsed and validated."""
    from banyan.sampling.params import SamplingParams
    from banyan.structured.spec import json_schema_spec

    prompts: list[str] = []
    params: list[SamplingParams] = []
    owners: list[dict[str, Any]] = []
    for s, schema in enumerate(SCHEMAS):
        spec = json_schema_spec(schema, f"schema {s}")
        for k in range(per_schema):
            prompts.append(f"Answer in JSON ({s}, {k}):")
            params.append(SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                         seed=seed + 1000 * s + k, structured=spec))
            owners.append(schema)
    report = ValidityReport()
    for schema, out in zip(owners, engine.generate(prompts, params, use_tqdm=False), strict=True):
        check(schema, out.text, out.outputs[0].finish_reason, report)
    return report
