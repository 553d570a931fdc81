"""vLLM's and llmq's output constraints in an OpenAI body -> the wire's `response_format`/`guided`.

A body may constrain its output in one of these ways (two at once is a 400 naming both):

    response_format                      OpenAI's: text, json_object, json_schema
    structured_outputs: {json | regex | choice | grammar}   vLLM >= 0.10
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older fields
    guided: {regex | choice | grammar}   llmq's own (the wire's field as it is)

JSON ones become the wire's `response_format` (json_schema, or json_object for vLLM's
`json_object: true`); regex, choice and grammar (Lark or GBNF) the wire's `guided`. The workers
compile them with llguidance (worker/engine/structured_output.py), so the output always matches.

Reference: vLLM's `StructuredOutputsParams` (sampling_params.py) and its OpenAI protocol.py.
"""

from __future__ import annotations

import json
from typing import Any

from msgspec import Struct

__all__ = ["ConstraintError", "StructuredOutputs", "constraint_of"]


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: dict[str, Any] | str | None = None  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintError(ValueError):
    """Two constraints at once, or one malformed; `param` names the body field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def constraint_of(*, response_format: dict[str, Any] | None,
                  structured_outputs: StructuredOutputs | None,
                  guided: dict[str, Any] | None, guided_json: dict[str, Any] | str | None,
                  guided_regex: str | None, guided_choice: list[str] | None,
                  guided_grammar: str | None) -> dict[str, Any]:
    """The wire fields (`response_format` or `guided`, or none) for a body's constraint."""
    given: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and response_format != {"type": "text"}:
        given.append(("response_format", {"response_format": response_format}))
    if structured_outputs is not None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(structured_outputs, k) not in (None, False)]
        if len(kinds) != 1:
            raise ConstraintError("`structured_outputs` takes exactly one of json, regex, "
                                  f"choice, grammar, json_object; got {kinds or 'none'}",
                                  "structured_outputs")
        kind = kinds[0]
        value = getattr(structured_outputs, kind)
        given.append((f"structured_outputs.{kind}", _wire(kind, value, "structured_outputs")))
    for kind, value in (("json", guided_json), ("regex", guided_regex),
                        ("choice", guided_choice), ("grammar", guided_grammar)):
        if value is not None:
            given.append((f"guided_{kind}", _wire(kind, value, f"guided_{kind}")))
    if guided is not None:
        given.append(("guided", {"guided": guided}))
    if len(given) > 1:
        names = " and ".join(f"`{name}`" for name, _ in given)
        raise ConstraintError(f"{names} both constrain the output: give one", given[1][0])
    return given[0][1] if given else {}


def _wire(kind: str, value: Any, param: str) -> dict[str, Any]:
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise ConstraintError(f"`{param}`: the JSON schema is not JSON: {exc}",
                                      param) from None
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "response", "schema": schema}}}
    return {"guided": {kind: value}}
