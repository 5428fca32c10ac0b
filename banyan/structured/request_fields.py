"""The API's structured-output fields, read into one StructuredSpec.

OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}. vLLM: `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, and the newer `structured_outputs` {"json" | "regex" | "choice" | "grammar" |
"json_object"}. SGLang's /generate: `json_schema`, `regex`, `ebnf` in sampling_params. At most
one may be given; every problem is a ValueError whose text starts with the field's name.
"""

from __future__ import annotations

import json
from typing import Any

from banyan.structured.grammar import check_compiles
from banyan.structured.spec import (
    StructuredSpec,
    check_json_schema,
    choice_spec,
    json_schema_spec,
    text_spec,
)

_STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def response_format_spec(value: Any) -> StructuredSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict) or "type" not in value:
        raise ValueError("response_format: an object with a `type` is needed")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise ValueError("response_format.json_schema: an object with a `schema` is needed")
        schema = inner.get("schema", {"type": "object"})
        return json_schema_spec(schema, "response_format.json_schema.schema")
    raise ValueError(f"response_format.type: {kind!r} is not one of text, json_object, "
                     "json_schema")


def structured_outputs_spec(value: Any) -> StructuredSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("structured_outputs: an object is needed")
    if value.get("structural_tag") is not None:
        raise ValueError("structured_outputs.structural_tag: structural tags are not supported")
    given = [k for k in _STRUCTURED_OUTPUT_KEYS if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"structured_outputs: give one of {', '.join(given)}, not several")
    if not given:
        return None
    key = given[0]
    return _one(key, value[key], f"structured_outputs.{key}")


def _one(kind: str, value: Any, field: str) -> StructuredSpec:
    if kind == "json":
        return json_schema_spec(value, field)
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "choice":
        return choice_spec(value, field)
    return text_spec(kind, value, field)


def spec_from_fields(fields: dict[str, Any]) -> StructuredSpec | None:
    """The one spec the request's fields ask for (None: free text), checked to compile.
    `fields` maps API field names to values (absent or None: not given)."""
    candidates: list[tuple[str, StructuredSpec]] = []

    def add(field: str, spec: StructuredSpec | None) -> None:
        if spec is not None:
            candidates.append((field, spec))

    if fields.get("structural_tag") is not None:  # SGLang's; refused, not ignored
        raise ValueError("structural_tag: structural tags are not supported")
    add("response_format", response_format_spec(fields.get("response_format")))
    add("structured_outputs", structured_outputs_spec(fields.get("structured_outputs")))
    for field, kind in (("guided_json", "json"), ("json_schema", "json"),
                        ("guided_regex", "regex"), ("regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                        ("ebnf", "grammar")):
        if fields.get(field) is not None:
            add(field, _one(kind, fields[field], field))
    if len(candidates) > 1:
        names = ", ".join(f for f, _ in candidates)
        raise ValueError(f"{candidates[1][0]}: only one structured output constraint may be "
                         f"given, got {names}")
    if not candidates:
        return None
    field, spec = candidates[0]
    check_compiles(spec, field)
    return spec


def validate_spec(spec: StructuredSpec, field: str) -> None:
    """A spec built elsewhere (a tool choice): the same checks as a request's."""
    if spec.kind == "json":
        check_json_schema(json.loads(spec.value), field)
    check_compiles(spec, field)
