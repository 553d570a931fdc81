"""The JSON depth check the gateway runs on every JSON body before a decoder sees it."""

from __future__ import annotations

import json

import msgspec
import pytest

from llmq.gateway.body_limit import MAX_JSON_DEPTH, json_too_deep


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + close * depth).encode()


def test_json_nested_past_the_limit_is_too_deep() -> None:
    # Given JSON nested 1,000 deep, which the decoders cannot take (RecursionError)
    with pytest.raises(RecursionError):
        msgspec.json.decode(nested(1000))
    # Then it is too deep, and so is anything one level past the limit, arrays or objects
    assert json_too_deep(nested(1000))
    assert json_too_deep(nested(MAX_JSON_DEPTH + 1))
    assert json_too_deep(('{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1))
                         .encode())


def test_json_within_the_limit_passes() -> None:
    assert not json_too_deep(nested(MAX_JSON_DEPTH))
    # Many brackets side by side are wide, not deep
    assert not json_too_deep(json.dumps([[i] for i in range(5000)]).encode())
    # Brackets inside strings, escaped quotes included, do not nest
    text = json.dumps({"messages": [{"role": "user", "content": "[" * 2000 + '\\"{' * 500}]})
    assert not json_too_deep(text.encode())
