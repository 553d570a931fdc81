"""What a request may constrain its output to: OpenAI's `response_format` and vLLM's `guided`.

The structs only check shapes; whether a schema, regex or grammar compiles is the worker's gate's
question (worker/engine/input_processor.py), answered with `invalid_request` naming the problem.
`output_constraint` hands the engine the constraint as (kind, spec) text, which keeps the engine's
params hashable and its compile cache keyed on plain strings.

References: OpenAI's chat completions `response_format`; vLLM's guided decoding fields.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from llmq.protocol.encoding import json_encoder

__all__ = ["Guided", "JsonSchema", "ResponseFormat", "ResponseFormatJsonObject",
           "ResponseFormatJsonSchema", "ResponseFormatText", "constrains", "output_constraint"]


class JsonSchema(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """OpenAI's `response_format.json_schema`: the output is JSON valid under `schema`."""

    name: Annotated[str, Meta(max_length=256)] = "response"
    schema: dict[str, Any] | bool
    description: str | None = None
    strict: bool | None = None  # accepted for OpenAI clients; llmq always enforces the schema


class ResponseFormatText(Struct, tag="text", forbid_unknown_fields=True):
    """No constraint: OpenAI's default."""


class ResponseFormatJsonObject(Struct, tag="json_object", forbid_unknown_fields=True):
    """Any JSON object."""


class ResponseFormatJsonSchema(Struct, tag="json_schema", forbid_unknown_fields=True):
    json_schema: JsonSchema


# OpenAI's shapes: {"type": "text"}, {"type": "json_object"},
# {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}.
ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class Guided(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """vLLM-style guided decoding beyond JSON: exactly one of the three."""

    regex: Annotated[str, Meta(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    grammar: Annotated[str, Meta(min_length=1)] | None = None  # Lark, or GBNF (llama.cpp)

    def __post_init__(self) -> None:
        given = [n for n in ("regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"`guided` takes exactly one of `regex`, `choice`, `grammar`, "
                             f"got {' and '.join(given) if given else 'none'}")


def constrains(response_format: ResponseFormat | None) -> bool:
    return not isinstance(response_format, ResponseFormatText | None)


def output_constraint(response_format: ResponseFormat | None,
                      guided: Guided | None) -> tuple[str, str] | None:
    """(kind, spec) of the output constraint, as the engine's StructuredOutputParams takes
    them (the schema and the choices as JSON text); None when the output is free."""
    if isinstance(response_format, ResponseFormatJsonObject):
        return "json_object", ""
    if isinstance(response_format, ResponseFormatJsonSchema):
        return "json_schema", json_encoder.encode(response_format.json_schema.schema).decode()
    if guided is None:
        return None
    if guided.regex is not None:
        return "regex", guided.regex
    if guided.choice is not None:
        return "choice", json_encoder.encode(guided.choice).decode()
    assert guided.grammar is not None
    return "grammar", guided.grammar
