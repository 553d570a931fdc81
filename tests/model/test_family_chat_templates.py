"""Each family's chat-template conventions render exactly as transformers' apply_chat_template.

The templates below are written in the styles the families ship (Llama 3 headers with a dated
system turn, Qwen3's thinking switch and its stripping of past reasoning, Gemma's turns with the
system prompt folded into the first user turn and `model` for the assistant, Mistral's
`[INST]` with the system prompt before the last user message). Each is put in a tiny Hugging
Face folder's tokenizer_config.json and rendered by llmq's tokenizer and by transformers'
AutoTokenizer, for conversations with and without a system turn, multi-turn, and the
template's own switches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmq.worker.engine.model.tokenizer import Tokenizer
from tests.fixtures.tiny_gguf import write_tokenizer_files
from tests.fixtures.tiny_hf import VOCAB

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, roles must alternate') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}"""

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "  Name three colours.  "}],
    "multi-turn": [{"role": "system", "content": "Answer in French."},
                   {"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nBonjour !"},
                   {"role": "user", "content": "How are you?"}],
}
CASES = [
    ("llama3", LLAMA3, {}), ("llama3", LLAMA3, {"date_string": "01 Dec 2026"}),
    ("qwen3", QWEN3, {}), ("qwen3", QWEN3, {"enable_thinking": False}),
    ("qwen3", QWEN3, {"enable_thinking": True}),
    ("gemma", GEMMA, {}), ("mistral", MISTRAL, {}),
]


def write_folder(path: Path, template: str) -> Path:
    path.mkdir(parents=True)
    write_tokenizer_files(path, VOCAB)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize(("family", "template", "switches"), CASES,
                         ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in s.items()) or 'plain'}"
                              for f, _, s in CASES])
def test_family_template_renders_as_transformers(tmp_path, family, template, switches,
                                                 conversation):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Given a folder whose tokenizer carries the family's template
    folder = write_folder(tmp_path / family, template)
    messages = CONVERSATIONS[conversation]
    # When llmq and transformers render the conversation with a generation prompt
    ours = Tokenizer.from_hf_dir(folder).apply_chat_template(messages, True, **switches)
    theirs = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **switches)
    # Then the text is identical
    assert ours == theirs
