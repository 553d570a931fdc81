"""Tool calling as OpenAI and vLLM do it: `tools` and `tool_choice` in, `tool_calls` out.

In: `tools` go onto the wire as they are (llmq.protocol.tools; the worker renders them with the
model's chat template, or with a documented tool prompt for a template that has no tool support:
worker/engine/tool_prompt.py). `tool_choice`:

    "none"        the tools are shown to the model, and its output is never read as calls
    "auto"        the output is read as calls when it is written as one (below), else content
    "required"    the output is one call (several with `parallel_tool_calls`) of any tool
    {"type": "function", "function": {"name": ...}}   one call of that tool

`required` and named calls are enforced by the workers' grammar engine (llguidance): a Lark
grammar whose calls are `%json` schemas (each tool's name as a constant and its `parameters` as
the arguments' schema, closed to other keys unless it allows them), written in any of the three
families' forms, so whichever form the model is trained on it can take, and the output cannot
fail to parse or to validate.

Out: the families' forms, each told by its marker, so one parser reads them all:

    Hermes / Qwen  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (repeated)
    Mistral        [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    Llama 3        {"name": "f", "parameters": {...}}   (after `<|python_tag|>`, or alone;
                   several separated by `; `)

References: vLLM's entrypoints/openai/tool_parsers (hermes_tool_parser.py,
mistral_tool_parser.py, llama_tool_parser.py) and its guided decoding of `required` and named
tool choices (protocol.py, `_get_guided_json_from_tool`); llguidance's Lark syntax (`%json`).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = ["ToolCallError", "grammar_for", "parse_tool_calls", "streamable_length",
           "tool_call_id"]

MAX_PARALLEL_CALLS = 4  # the grammar's bound, so an eager model cannot call forever
_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
# the JSON layout the workers write schemas in (worker/engine/structured_output.py)
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolCallError(ValueError):
    """A `tools` / `tool_choice` the gateway cannot honour; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_for(tools: list[Any], tool_choice: Any, parallel: bool) -> str | None:
    """The Lark grammar a `required` or named `tool_choice` constrains the output to; None for
    `auto` and `none` (free output)."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [t.get("function") or {} for t in tools if isinstance(t, dict)]
    if tool_choice == "required":
        chosen = functions
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f.get("name") == name]
        if not chosen:
            raise ToolCallError(f"`tool_choice` names the function {name!r}, which is not "
                                "among `tools`", "tool_choice")
        parallel = False
    else:
        raise ToolCallError('`tool_choice` must be "none", "auto", "required" or {"type": '
                            '"function", "function": {"name": ...}}', "tool_choice")
    most = MAX_PARALLEL_CALLS if parallel else 1

    def call(key: str) -> str:
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f.get("name")},
            key: _closed(f.get("parameters") or {"type": "object"})},
            "required": ["name", key], "additionalProperties": False} for f in chosen],
            "x-guidance": _JSON_LAYOUT}
        return "%json " + json.dumps(schema)

    def repeated(one: str, sep: str) -> str:
        return " | ".join(f' "{sep}" '.join([one] * k) for k in range(1, most + 1))

    return "\n".join([
        "start: hermes | mistral | llama",
        "hermes: " + repeated(r'"<tool_call>\n" call_a "\n</tool_call>"', r"\n"),
        'mistral: "[TOOL_CALLS][" (' + repeated("call_a", ", ") + ') "]"',
        "llama: " + repeated("call_p", "; "),
        "call_a: " + call("arguments"),
        "call_p: " + call("parameters"),
    ])


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema, naming only its own properties unless it says otherwise (as
    OpenAI's strict mode): a model held to a schema with open properties can invent keys."""
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def parse_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content before the calls or None, [(name, arguments JSON text)]) when `text` is written
    as tool calls in one of the families' forms; None when it is plain content."""
    if (start := text.find("<tool_call>")) >= 0:
        bodies = [_call(m.group(1)) for m in _HERMES.finditer(text, start)]
    elif (start := text.find("[TOOL_CALLS]")) >= 0:
        bodies = _array(text[start + len("[TOOL_CALLS]"):])
    else:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>"):]
        if not stripped.startswith("{"):
            return None
        # several calls are joined by `; `: the split takes the braces next to it, put back
        parts = re.split(r"\}\s*;\s*\{", stripped.strip())
        bodies = [_call(("{" if i else "") + part + ("}" if i < len(parts) - 1 else ""))
                  for i, part in enumerate(parts)]
    calls = [call for call in bodies if call is not None]
    if not calls or len(calls) != len(bodies):
        return None
    content = text[:start].strip() or None
    return content, calls


def streamable_length(text: str) -> int:
    """How much of `text` can be streamed as content while tool calls are being read: all of
    it up to where a call starts or may start (a marker, a marker's beginning at the end, or
    output that opens with `{`, Llama 3's bare JSON)."""
    if text.lstrip().startswith("{") or not text.strip():
        return 0
    for i, char in enumerate(text):
        if char in "<[" and any(m.startswith(text[i:i + len(m)]) for m in _MARKERS):
            return i
    return len(text)


def tool_call_id(public_id: str, choice: int, index: int) -> str:
    """A call's id, the same on every reading of the request (a resumed stream, the result)."""
    digest = hashlib.sha256(f"{public_id}/{choice}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _call(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _named(value)


def _named(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _array(body: str) -> list[tuple[str, str] | None]:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return [None]
    return [_named(v) for v in (value if isinstance(value, list) else [value])]

