"""Chat messages and tools for the chat template: what a template with tool support needs, and
a documented tool prompt for a template without (SmolLM2's, the default model's).

A template that uses the `tools` variable (Qwen2.5, Hermes, Llama 3.1+, Mistral) gets the tools
as it is, and the calls in the history with their `arguments` as objects, which is how those
templates print them (vLLM's chat_utils does the same).

A template that never mentions `tools` would drop them silently, and fails on an assistant turn
whose content is null. For those, llmq writes the tools into the system prompt in Hermes' format
(NousResearch's Hermes-2-Pro function-calling prompt, which Qwen2.5 also follows) and rewrites
the history in the same words:

    system:    <the system prompt, if any>\n\n# Tools ... <tools>{function JSON}...</tools> ...
    assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>
    user:      <tool_response>\n12 C\n</tool_response>          (a `tool` turn)

so the model is asked to answer in the `<tool_call>` form the gateway parses
(gateway/tool_calls.py).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["TOOL_PROMPT", "chat_for_template"]

TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def chat_for_template(template: str | None, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with `template`: its own tool support when it has one, else
    the tool prompt above (tools then None: they are in the messages)."""
    if template is not None and "tools" in template:
        return [_arguments_as_objects(m) for m in messages], tools
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, tools
    chat = [_plain(m) for m in messages]
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                    for t in tools))
        if chat and chat[0]["role"] == "system":
            chat[0] = {**chat[0], "content": f"{chat[0]['content']}\n\n{prompt}"}
        else:
            chat.insert(0, {"role": "system", "content": prompt})
    return chat, None


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**call, "function": {**call["function"],
                              "arguments": _arguments(call["function"]["arguments"])}}
        for call in calls]}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template prints it as the text it is


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message in the tool prompt's words, with only role and string content."""
    if message.get("role") == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message.get("content") or ""}
    written = [json.dumps({"name": c["function"]["name"],
                           "arguments": _arguments(c["function"]["arguments"])},
                          ensure_ascii=False) for c in calls]
    text = "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in written)
    content = message.get("content")
    return {"role": "assistant", "content": f"{content}\n{text}" if content else text}
