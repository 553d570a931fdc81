"""BodyLimit: the gateway reads no request body past a size, and no JSON nested past a depth.

An unbounded body is memory an anonymous client can make the gateway spend (a 300 MB body
grew it by 770 MB before the JSON decoder refused it), and JSON nested a thousand deep makes the
decoders raise RecursionError. So, as plain ASGI around the routes:

- a `Content-Length` over the limit is answered 413 before a byte is read;
- a body that streams past the limit (chunked, or longer than it said) is cut there: reading it
  raises the 413, which the app answers like any `APIError`;
- a JSON body nested deeper than `MAX_JSON_DEPTH` is a 400, checked once the body is whole and
  before any decoder sees it.

The limit is `max_body_bytes` (`llmq serve --max-body-bytes`) on every route but the file upload
(`POST /v1/files`), whose body is a file of up to `max_file_bytes` in multipart framing.
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmq.gateway.errors import APIError, bad_request
from llmq.gateway.state import json_response

__all__ = ["MAX_JSON_DEPTH", "BodyLimit", "json_too_deep"]

MAX_JSON_DEPTH = 400  # nesting levels; msgspec and json give up near 1,000 (the recursion limit)
_MULTIPART_ROOM = 64 << 10  # bytes of multipart framing and form fields beside an uploaded file
_UPLOAD_PATH = "/v1/files"

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # brackets inside don't nest
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def json_too_deep(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `data` nests arrays and objects deeper than `max_depth`.

    Text that is not JSON gets an answer too; its decoder will say what is wrong with it."""
    # NOTE: fewer brackets than the limit cannot nest past it: the common case costs two counts.
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    steps = array("b", _STRING.sub(b"", data).translate(None, _NOT_BRACKETS).translate(_STEPS))
    return max(accumulate(steps), default=0) > max_depth


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this gateway accepts ({limit} bytes)",
                    "invalid_request_error", code="request_too_large")


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_file_bytes: int,
                 max_json_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_file_bytes = max_file_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["path"] == _UPLOAD_PATH and scope["method"] == "POST"
        limit = self.max_file_bytes + _MULTIPART_ROOM if upload else self.max_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            error = too_large(limit)
            await json_response(error.body(), error.status)(scope, receive, send)
            return
        received = 0
        # NOTE: a JSON body is kept whole (it is at most `limit`) for the depth check; the
        # handler holds it whole anyway. Uploads are multipart, never checked.
        chunks: list[bytes] | None = None if upload else []

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] != "http.request":
                return message
            body = message.get("body", b"")
            received += len(body)
            if received > limit:
                raise too_large(limit)
            if chunks is not None:
                chunks.append(body)
                if not message.get("more_body", False):
                    whole = b"".join(chunks)
                    chunks.clear()
                    if json_too_deep(whole, self.max_json_depth):
                        raise bad_request(f"the JSON body nests deeper than "
                                          f"{self.max_json_depth} levels")
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
