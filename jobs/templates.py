"""RequestTemplate: a stage's request made from one row, with sandboxed Jinja templates.

    template = RequestTemplate({"prompt": "Summarise: {{ text }}", "max_tokens": 64,
                                "seed": ColumnRef("row_seed")})
    body = template.render({"text": "...", "row_seed": 7})   # {"prompt": "Summarise: ...", ...}

Each request field is a constant (`max_tokens: 64`), a template string (any string with `{{`,
`{%` or `{#`: rendered to text) or a `ColumnRef` (the column's value as it is, int or list or
dict, for `seed`, `stop`, `response_format`...). Lists and mappings are walked, so `messages` is
a list of `{role, content}` whose contents are templates.

Templates run in Jinja's immutable sandbox with strict undefined: a row's text is substituted as
data and never parsed as a template (a column holding `{{ 7*7 }}` stays those characters), a
template cannot reach Python internals, and a missing column is an error (`RowError`), not an
empty string. Column names that are not identifiers are reached as `row["my column"]`.

`Condition` is a stage's `when:`, a Jinja expression over the same context
(`label_parsed.label == "spam"`, `summary_finish_reason == "stop"`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

__all__ = ["ColumnRef", "Condition", "RequestTemplate", "RowError", "SpecError"]

# NOTE: autoescape off: the output is a prompt, not HTML; keep_trailing_newline: a prompt's
# final newline can matter to the model.
_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False,
                                     keep_trailing_newline=True)
_MARKERS = ("{{", "{%", "{#")


class SpecError(ValueError):
    """The job itself is wrong (a template that does not compile, an unknown field...)."""


class RowError(Exception):
    """One row cannot be run (a missing column, a template that fails on it); the reason says
    what, and the job goes on with the other rows."""


@dataclass(frozen=True)
class ColumnRef:
    """A request field taken from a column, value as it is (`summary_parsed.label` walks
    into a mapping)."""

    column: str

    def value(self, context: Mapping[str, Any]) -> Any:
        head, *rest = self.column.split(".")
        if head not in context:
            raise RowError(f"missing column {head!r}")
        value = context[head]
        for key in rest:
            if not isinstance(value, Mapping) or key not in value:
                raise RowError(f"column {self.column!r}: no field {key!r}")
            value = value[key]
        return value


def _problem(exc: Exception) -> str:
    if isinstance(exc, jinja2.UndefinedError):
        # "'summary' is undefined" -> the column's name, which is what the user needs
        return f"missing column or field: {exc.message}"
    if isinstance(exc, SecurityError):
        return f"template not allowed in the sandbox: {exc}"
    return f"template failed: {type(exc).__name__}: {exc}"


def _context(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, "row": row}


class _Compiled:
    """One field's value, compiled: a template, a column, a container of those, or a constant."""

    def __init__(self, value: Any, where: str) -> None:
        self.template: jinja2.Template | None = None
        self.column: ColumnRef | None = None
        self.items: list[_Compiled] | None = None
        self.fields: dict[str, _Compiled] | None = None
        self.constant: Any = None
        if isinstance(value, str) and any(marker in value for marker in _MARKERS):
            try:
                self.template = _ENV.from_string(value)
            except jinja2.TemplateSyntaxError as exc:
                raise SpecError(f"{where}: template syntax error on its line {exc.lineno}: "
                                f"{exc.message}") from None
        elif isinstance(value, ColumnRef):
            self.column = value
        elif isinstance(value, list):
            self.items = [_Compiled(item, f"{where}[{i}]") for i, item in enumerate(value)]
        elif isinstance(value, Mapping):
            self.fields = {str(k): _Compiled(v, f"{where}.{k}") for k, v in value.items()}
        else:
            self.constant = value

    def render(self, context: Mapping[str, Any]) -> Any:
        if self.template is not None:
            return self.template.render(context)
        if self.column is not None:
            return self.column.value(context)
        if self.items is not None:
            return [item.render(context) for item in self.items]
        if self.fields is not None:
            return {key: value.render(context) for key, value in self.fields.items()}
        return self.constant


class RequestTemplate:
    """Request fields (wire names) from a row: see the module docstring."""

    def __init__(self, fields: Mapping[str, Any], where: str = "stage") -> None:
        self.field_names = list(fields)
        self._compiled = {name: _Compiled(value, f"{where}.{name}")
                          for name, value in fields.items()}

    def render(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The request for `row` (its columns, and earlier stages' columns); RowError if not."""
        context = _context(row)
        try:
            return {name: field.render(context) for name, field in self._compiled.items()}
        except RowError:
            raise
        except Exception as exc:  # noqa: BLE001 - any template failure is this row's problem
            raise RowError(_problem(exc)) from None


class Condition:
    """A `when:` expression; `holds(row)` is its truth, RowError when it cannot be evaluated."""

    def __init__(self, expression: str, where: str = "when") -> None:
        self.expression = expression
        try:
            self._compiled = _ENV.compile_expression(expression, undefined_to_none=False)
        except jinja2.TemplateSyntaxError as exc:
            raise SpecError(f"{where}: not an expression ({exc.message}): {expression!r}") \
                from None

    def holds(self, row: Mapping[str, Any]) -> bool:
        try:
            return bool(self._compiled(**_context(row)))
        except Exception as exc:  # noqa: BLE001 - a failing condition is this row's problem
            raise RowError(f"when {self.expression!r}: {_problem(exc)}") from None
