"""Tools and tool-call histories for chat templates with and without tool support."""

from __future__ import annotations

import json

from llmq.worker.engine.model.chat_template import ChatTemplate
from llmq.worker.engine.tool_prompt import chat_for_template
from tests.fixtures.tiny_gguf import SMOLLM2_CHAT_TEMPLATE

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
# A template with tool support, in the shape of Qwen2.5's (trimmed).
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


def test_a_template_without_tool_support_gets_the_tool_prompt_and_a_plain_history() -> None:
    chat, tools = chat_for_template(SMOLLM2_CHAT_TEMPLATE, HISTORY, [TOOL])
    text = ChatTemplate(SMOLLM2_CHAT_TEMPLATE).render(chat)
    # Then the tools are in the system prompt, the call and its answer in Hermes' words
    assert tools is None and chat[0]["role"] == "system"
    assert json.dumps(TOOL) in text and "<tool_call></tool_call> XML tags" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>" in text


def test_a_template_with_tool_support_gets_the_tools_and_arguments_as_objects() -> None:
    chat, tools = chat_for_template(TOOL_TEMPLATE, HISTORY, [TOOL])
    text = ChatTemplate(TOOL_TEMPLATE).render(chat, tools=tools)
    assert tools == [TOOL] and text.startswith("<tools>")
    assert 'assistant: <tool_call>get_weather {"city": "Oslo"}</tool_call>' in text


def test_a_chat_without_tools_is_left_as_it_is() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_for_template(SMOLLM2_CHAT_TEMPLATE, messages, None) == (messages, None)
