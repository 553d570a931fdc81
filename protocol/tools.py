"""Tools on the wire: the functions a chat request offers its model, and the calls in its history.

They have OpenAI's shapes, so a chat history passes through unchanged:

    tools:  [{"type": "function", "function": {"name": "get_weather", "description": "...",
              "parameters": {<JSON schema>}}}]
    an assistant turn that called them: {"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    the answer: {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}

The worker renders `tools` as the chat template's `tools` variable (worker/engine/tool_prompt.py
for templates that have none); what the model calls is parsed by the gateway.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

__all__ = ["FunctionCall", "FunctionDefinition", "MAX_TOOLS", "Tool", "ToolCall", "ToolName"]

MAX_TOOLS = 128
# OpenAI's rule for function names.
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted for OpenAI clients; required calls always conform


class Tool(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, Meta(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall
