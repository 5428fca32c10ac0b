"""What a request asks its output to match, and the check that the grammar library can enforce
all of it.

A `StructuredSpec` is the one form every API field turns into (OpenAI's `response_format`,
vLLM's `guided_*` and `structured_outputs`, SGLang's `json_schema`/`regex`/`ebnf`, a tool
choice): it travels inside SamplingParams to the engine, where `banyan.structured.grammar`
compiles it. A JSON schema is checked keyword by keyword against what xgrammar enforces: a
keyword it would ignore is refused (ValueError naming it) rather than silently weakened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Keywords xgrammar turns into grammar rules (checked against its JSON-schema converter).
_ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "pattern", "format", "minProperties", "maxProperties",
}
# Keywords that constrain nothing (documentation and metadata).
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "discriminator", "strict",
}
# String formats xgrammar has rules for; any other format would be plain text. Left out,
# because their rules are looser than validators: ipv4 (octets with leading zeros, "010") and
# date / date-time (any day 01-31 in any month, "09-31").
_FORMATS = {
    "time", "duration", "email", "uuid", "ipv6", "hostname",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
}


@dataclass(slots=True, frozen=True)
class StructuredSpec:
    """kind: one of KINDS; value: the schema as JSON text, the regex, the choices as a JSON
    list, or the EBNF grammar (empty for json_object)."""

    kind: str
    value: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)


def json_schema_spec(schema: Any, field: str) -> StructuredSpec:
    """A JSON-schema spec, checked (ValueError naming `field` and the keyword)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: not valid JSON ({exc.msg})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object")
    check_json_schema(schema, field)
    return StructuredSpec("json", json.dumps(schema))


def choice_spec(choices: Any, field: str) -> StructuredSpec:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"{field}: a non-empty list of non-empty strings is needed")
    return StructuredSpec("choice", json.dumps(choices))


def text_spec(kind: str, value: Any, field: str) -> StructuredSpec:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: a non-empty string is needed")
    return StructuredSpec(kind, value)


def check_json_schema(schema: Any, field: str, path: str = "") -> None:
    """ValueError for the first keyword xgrammar would not enforce, with its place."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: schema at {path or '/'} must be an object or a boolean")
    # xgrammar writes a string's format or pattern as its whole grammar: a length limit
    # beside either would be dropped.
    shaped = [k for k in ("format", "pattern") if k in schema]
    limits = [k for k in ("minLength", "maxLength") if k in schema]
    if shaped and limits:
        raise ValueError(f"{field}: JSON schema keyword {limits[0]!r} together with "
                         f"{shaped[0]!r} (at {path or '/'}) cannot be enforced")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            raise ValueError(f"{field}: JSON schema keyword {key!r} (at {where}) cannot be "
                             "enforced by the grammar engine")
        if key == "format" and value not in _FORMATS:
            raise ValueError(f"{field}: string format {value!r} (at {where}) cannot be enforced")
        if key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise ValueError(f"{field}: {where} must be an object")
            for name, sub in value.items():
                check_json_schema(sub, field, f"{where}/{name}")
        elif key in ("items", "additionalProperties") and not isinstance(value, bool):
            check_json_schema(value, field, where)
        elif key in ("anyOf", "prefixItems"):
            if not isinstance(value, list):
                raise ValueError(f"{field}: {where} must be a list")
            for i, sub in enumerate(value):
                check_json_schema(sub, field, f"{where}/{i}")
        elif key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ValueError(f"{field}: only local references (#/...) are supported at {where}")
