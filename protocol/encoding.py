"""The two encodings of every llmq stream entry, and reading the fields Redis hands back.

An entry carries its object in exactly one field named after the encoding: `json` (a UTF-8 JSON
object) or `msgpack` (the same object as MessagePack). Events are written in the encoding their
request used. The encoders are long-lived (msgspec's advice: one per type, reused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

__all__ = ["ENCODINGS", "Encoding", "as_str", "encoders", "field_items", "json_encoder",
           "msgpack_encoder"]

Encoding = Literal["json", "msgpack"]
ENCODINGS: tuple[Encoding, ...] = ("json", "msgpack")

json_encoder = msgspec.json.Encoder()
msgpack_encoder = msgspec.msgpack.Encoder()
encoders: dict[str, msgspec.json.Encoder | msgspec.msgpack.Encoder] = {
    "json": json_encoder, "msgpack": msgpack_encoder}


def as_str(value: Any) -> str:
    """A reply value (bytes, from a client that does not decode responses) as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def field_items(fields: Mapping[Any, Any]) -> list[tuple[str, bytes]]:
    """An entry's fields as (name, bytes) pairs, whatever shape the client returned them in."""
    return [(as_str(k), v.encode() if isinstance(v, str) else v) for k, v in fields.items()]
