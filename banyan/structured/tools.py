"""Tool calling in the Hermes/Qwen format: the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, which become OpenAI
`tool_calls`.

- `tool_call_grammar`: the EBNF grammar of exactly one call to one of the given tools (used for
  tool_choice "required" and a named function), built from each tool's parameter schema.
- `parse_tool_calls`: a finished text -> (content, calls).
- `ToolCallStream`: text deltas -> OpenAI chat deltas: content streams as it comes, each call
  is sent as one `tool_calls` delta (index, id, type, name and the whole arguments string) the
  moment its block closes, which the openai client assembles like any other.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from banyan.structured.grammar import json_schema_ebnf
from banyan.structured.spec import StructuredSpec, check_json_schema

START, END = "<tool_call>", "</tool_call>"

# For chat templates that do not render `tools` themselves: the Hermes system prompt.
_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools`, checked (ValueError naming the field)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools: a non-empty list is needed")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}]: {{\"type\": \"function\", \"function\": {{...}}}} "
                             "is needed")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name: a non-empty string is needed")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: a JSON schema object is needed")
        out.append(tool)
    return out


def chosen_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools a call must be made to (None: the model decides, or makes no call)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise ValueError(f"tool_choice.function.name: no tool named {name!r} in tools")
        return named
    raise ValueError("tool_choice: none, auto, required or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}} is needed")


def tool_call_grammar(tools: list[dict[str, Any]]) -> StructuredSpec:
    """Exactly one `<tool_call>{"name": N, "arguments": {...}}</tool_call>` to one of `tools`,
    its arguments valid for that tool's parameters (ValueError naming an unenforceable
    keyword)."""
    calls = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        check_json_schema(params, f"tools[{i}].function.parameters")
        calls.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                       "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call = re.sub(r"(?m)^root ::=", "tool_call_json ::=", json_schema_ebnf(json.dumps(schema)))
    root = f'root ::= "{START}\\n" tool_call_json "\\n{END}"\n'
    return StructuredSpec("grammar", root + call)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    return _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


def template_renders_tools(chat_template: Any) -> bool:
    return isinstance(chat_template, str) and "tools" in chat_template


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _parse_block(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], args if isinstance(args, str) else json.dumps(args))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content outside the calls, the calls). A block that is not a call ({"name": ...}
    JSON) stays in the content, as the model wrote it."""
    stream = ToolCallStream()
    content = "".join(d.get("content", "") for d in stream.feed(text, final=True))
    return content, stream.calls


class ToolCallStream:
    """Splits streamed text into content deltas and tool-call deltas."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text that may be (the start of) a tool call block

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Chat deltas for this text; final: the request ended (an unclosed block is parsed
        as it is, or given back as content)."""
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        content: list[str] = []
        while self._buffer:
            start = self._buffer.find(START)
            if start < 0:
                keep = 0 if final else _partial_prefix(self._buffer, START)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content.append(self._buffer[:start])
            end = self._buffer.find(END, start)
            if end < 0 and not final:
                self._buffer = self._buffer[start:]
                break
            body_end = len(self._buffer) if end < 0 else end
            block = self._buffer[start : body_end + (len(END) if end >= 0 else 0)]
            call = _parse_block(self._buffer[start + len(START) : body_end].strip())
            self._buffer = "" if end < 0 else self._buffer[end + len(END) :]
            if call is None:
                content.append(block)
                continue
            if "".join(content):
                deltas.append({"content": "".join(content)})
            content = []
            deltas.append({"tool_calls": [call.openai(len(self.calls))]})
            self.calls.append(call)
        if "".join(content):
            deltas.append({"content": "".join(content)})
        return deltas


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may be one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
