"""ChatTemplate: a model's own jinja2 chat template, rendered the way transformers renders it.

Reference: transformers' `utils/chat_template_utils.py` (`_cached_compile_jinja_template`,
`render_jinja_template`) and `apply_chat_template` in `tokenization_utils_base.py`. The
environment is the same: a sandbox (templates come from model files, i.e. untrusted code) with
`trim_blocks=True, lstrip_blocks=True`, the `loopcontrols` extension, a `{% generation %}` tag,
a `tojson` filter that does not HTML-escape, and the globals `raise_exception`, `strftime_now`,
`dict` and `namespace`. With those, the output is byte-identical to
`apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import json
import logging
import secrets
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to find assistant tokens for training masks; for inference only the
    text matters, but templates that use it must still compile.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    # NOTE: like transformers, refuse underscore names so a template cannot reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


class _TemplateDict:
    # NOTE: templates get `dict(...)` and `dict.fromkeys(...)` but not the type itself, so they
    # cannot reach type machinery through it (transformers' TemplateDict).
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: jinja's own tojson HTML-escapes `<>&'`, which would corrupt prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates may refer to.

    `special_tokens` maps names such as `bos_token` / `eos_token` to their text; transformers
    passes the same names (its `special_tokens_map`) to every render.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _make_environment().from_string(source)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation; extra keyword arguments become template variables."""
        # NOTE: transformers drops keys whose value is None (OpenAI clients send content=None,
        # tool_calls=None) because templates handle a missing key but print a None as "None".
        chat = []
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            chat.append({key: value for key, value in message.items() if value is not None})
        variables = {**self.special_tokens, **kwargs}
        return self._template.render(
            messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables)

    def render_parts(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                     **kwargs: Any) -> list[tuple[str, bool]] | None:
        """The rendered conversation as (text, from_content) parts, in order: what came from a
        message's `content` and what the template itself wrote. Their concatenation is exactly
        `render(...)`. None when the template transforms content in a way the parts cannot
        follow (it slices it, or branches on its exact value): treat the whole text as content.

        NOTE: each content is rendered between markers made of private-use characters and a
        random nonce, so content cannot forge or close them; a template that trims content
        (`| trim`, as Llama 3's does) is followed by marking the trimmed content instead.
        """
        plain = self.render(messages, add_generation_prompt, **kwargs)
        nonce = secrets.token_hex(8)
        begin, end = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        for strip in (False, True):
            marked = [_marked(m, begin, end, strip) for m in messages]
            parts = _split_marked(self.render(marked, add_generation_prompt, **kwargs), begin, end)
            if parts is not None and "".join(text for text, _ in parts) == plain:
                return [part for part in parts if part[0]]
        return None


def _marked(message: Any, begin: str, end: str, strip: bool) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        return message
    return {**message, "content": begin + (content.strip() if strip else content) + end}


def _split_marked(text: str, begin: str, end: str) -> list[tuple[str, bool]] | None:
    parts: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(begin, pos)) >= 0:
        stop = text.find(end, start + len(begin))
        if stop < 0:
            return None
        parts += [(text[pos:start], False), (text[start + len(begin):stop], True)]
        pos = stop + len(end)
    parts.append((text[pos:], False))
    if any(begin in t or end in t for t, _ in parts):
        return None  # markers cut apart or nested: the template sliced content
    return parts
