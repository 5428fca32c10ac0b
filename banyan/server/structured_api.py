"""The HTTP side of structured output and tool calling: request fields -> a StructuredSpec (400
naming the field when it cannot be enforced), tools into the chat template, and chat output
-> `tool_calls`. The engine side lives in banyan/structured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from banyan.server.errors import bad_request
from banyan.structured.request_fields import spec_from_fields, validate_spec
from banyan.structured.spec import StructuredSpec
from banyan.structured.tools import (
    ToolCallStream,
    check_tools,
    chosen_tools,
    parse_tool_calls,
    template_renders_tools,
    tool_call_grammar,
    tools_system_prompt,
)

# Request fields (OpenAI, vLLM and SGLang names) that ask for structured output.
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "json_schema", "regex", "ebnf", "structural_tag")


def structured_spec(body: BaseModel) -> StructuredSpec | None:
    """What the body's structured-output fields ask for; 400 naming the field otherwise."""
    values = {name: getattr(body, name, None) for name in FIELDS}
    try:
        return spec_from_fields(values)
    except ValueError as exc:
        raise bad_request(str(exc), str(exc).split(":", 1)[0].split(".")[0]) from None


@dataclass(slots=True)
class ChatTools:
    """A chat request's tools: how the prompt shows them, the grammar a forced call needs,
    and the parser of the output."""

    tools: list[dict[str, Any]]
    forced: StructuredSpec | None  # tool_choice required or named: exactly one call

    @classmethod
    def from_body(cls, tools: Any, tool_choice: Any, parser: str) -> ChatTools | None:
        """None when the request has no tools or tool_choice is "none" (plain chat)."""
        if tools is None or tool_choice == "none":
            if tool_choice not in (None, "none", "auto"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if parser == "none":
            raise bad_request("tool calling is off on this server (--tool-call-parser none)",
                              "tools")
        try:
            checked = check_tools(tools)
            forced = chosen_tools(checked, tool_choice)
            spec = tool_call_grammar(forced) if forced is not None else None
            if spec is not None:
                validate_spec(spec, "tools")
        except ValueError as exc:
            field = str(exc).split(":", 1)[0].split("[")[0].split(".")[0]
            raise bad_request(str(exc), field) from None
        return cls(checked, spec)

    def render(self, messages: list[dict[str, Any]], chat_template: Any,
               template_kwargs: dict[str, Any] | None) -> tuple[list[dict[str, Any]],
                                                                dict[str, Any]]:
        """(messages, template kwargs) with the tools: through the template's own `tools`
        support, or a Hermes system prompt when the template has none."""
        kwargs = dict(template_kwargs or {})
        if template_renders_tools(chat_template):
            kwargs["tools"] = self.tools
            return messages, kwargs
        prompt = tools_system_prompt(self.tools)
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{prompt}")
            return [first, *messages[1:]], kwargs
        return [{"role": "system", "content": prompt}, *messages], kwargs

    @staticmethod
    def message(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice, and its finish reason ("tool_calls"
        when it made calls)."""
        content, calls = parse_tool_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content.strip() or None,
                   "tool_calls": [c.openai() for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolDeltas:
    """Per choice of a streamed chat: text deltas -> chat deltas (content and tool calls)."""

    def __init__(self, choices: int) -> None:
        self._streams = [ToolCallStream() for _ in range(choices)]

    def deltas(self, index: int, text: str, finish_reason: str | None) -> tuple[
            list[dict[str, Any]], str | None]:
        stream = self._streams[index]
        deltas = stream.feed(text, final=finish_reason is not None)
        if finish_reason == "stop" and stream.calls:
            finish_reason = "tool_calls"
        return deltas, finish_reason
