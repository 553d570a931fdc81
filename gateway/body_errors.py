"""BodyError: an OpenAI body llmq cannot run, and msgspec's messages about one in plain words.

Shared by the body decoders (gateway/openai_request.py) and what converts their bodies.
"""

from __future__ import annotations

import re

__all__ = ["BodyError", "decode_error", "path_of"]


class BodyError(Exception):
    """A body llmq cannot run; `param` names the OpenAI field at fault when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# msgspec's messages for an object's fields; those on the body itself have no `` - at `$...` ``.
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?(.*)`)?\Z")
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`(?: - at `\$\.?(.*)`)?\Z")


def decode_error(message: str, endpoint: str) -> BodyError:
    """BodyError for a msgspec message: an unknown or missing field of the body itself in plain
    words, the rest as msgspec words it (naming the path); `param` names the field."""
    if match := _UNKNOWN_FIELD.match(message) or _MISSING_FIELD.match(message):
        field, at = match[1], match[2]
        if at:  # a field of a nested object, e.g. messages[0].role
            return BodyError(message, f"{at}.{field}")
        if match.re is _UNKNOWN_FIELD:
            return BodyError(f"body field `{field}` is not supported for {endpoint}", field)
        return BodyError(f"the body needs `{field}` for {endpoint}", field)
    if message.startswith("Expected `object`") and " - at `$" not in message:
        return BodyError("the body must be a JSON object")
    return BodyError(message, path_of(message))


def path_of(message: str) -> str | None:
    """The field a msgspec message points at (``... - at `$.messages[0].role```)."""
    _, found, path = message.rpartition(" - at `$.")
    return path.removesuffix("`") if found else None
