"""The OpenAI batch file format: input lines -> llmq requests, results -> output/error lines.

Input line (https://platform.openai.com/docs/guides/batch):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}

`url` is /v1/completions (`prompt`: a string, or token ids) or /v1/chat/completions
(`messages`). Body fields map onto the llmq request (vLLM's extras `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids` too; `response_format` and
`n` pass through, so each output body lists `n` choices that follow the format); a field llmq
cannot honour (`logprobs`, `tools`...) fails the line rather than being ignored.

Output line: {"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error":
null}, the body a `text_completion` or `chat.completion` object with usage. Error line: a request
the worker failed has a `response` with status 400/500 and an OpenAI error body; a line that failed
validation, or did not run because the batch was cancelled, has `response: null` and an `error`
{code, message, line}. A line that is not a JSON object (`invalid_json_line`) fails the whole
batch instead (the file is not JSONL), with `batch_error` entries: gateway/batch_job.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from llmq.gateway.openai_request import CHAT, COMPLETIONS, BodyError, parse_body
from llmq.gateway.openai_response import (
    completion_id,
    completion_object,
    error_body,
    error_status,
)
from llmq.protocol import Done, Error

__all__ = ["CHAT", "COMPLETIONS", "INVALID_JSON", "BatchLine", "BatchLineError",
           "batch_error", "error_record", "failed_record", "output_record", "parse_line"]

_MAX_CUSTOM_ID = 512
INVALID_JSON = "invalid_json_line"  # OpenAI's code for a line that is not a JSON object


class BatchLineError(Exception):
    """A batch input line that cannot run; `custom_id` when it was readable, and OpenAI's
    error `code` (`invalid_json_line` when the line is not a JSON object: the file is not JSONL)."""

    def __init__(self, message: str, custom_id: str | None = None,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.custom_id = custom_id
        self.code = code


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    model: str | None
    request: dict[str, Any]  # the llmq request fields, without `id`


def parse_line(text: str, number: int) -> BatchLine:
    """Validate one input line as the worker will; BatchLineError saying why not."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"not JSON: {exc}", code=INVALID_JSON) from None
    if not isinstance(obj, dict):
        raise BatchLineError("a batch line is a JSON object", code=INVALID_JSON)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > _MAX_CUSTOM_ID:
        raise BatchLineError(f"`custom_id` must be a non-empty string of at most "
                             f"{_MAX_CUSTOM_ID} characters")
    if obj.get("method", "POST") != "POST":
        raise BatchLineError(f"`method` must be POST, got {obj.get('method')!r}", custom_id)
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise BatchLineError(f"unknown field `{sorted(unknown)[0]}`", custom_id)
    url = obj.get("url")
    if not isinstance(url, str):
        raise BatchLineError(f"`url` must be {COMPLETIONS} or {CHAT}, got {url!r}", custom_id)
    try:
        parsed = parse_body(url, obj.get("body"), batch=True)
    except BodyError as exc:
        raise BatchLineError(str(exc), custom_id) from None
    return BatchLine(number, custom_id, parsed.endpoint, parsed.model, parsed.request)


def batch_error(code: str, message: str, line: int | None = None,
                param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's `errors.data`, in OpenAI's shape."""
    return {"code": code, "message": message, "param": param, "line": line}


# -- results ---------------------------------------------------------------------------------------


def _record_id(request_id: str) -> str:
    return "batch_req_" + request_id.removeprefix("batch_")


def output_record(line: BatchLine, request_id: str, done: Done, model: str) -> dict[str, Any]:
    """The output line of a request that finished (finish_reason stop or length)."""
    body = completion_object(line.url, completion_id(line.url, request_id), line.model or model,
                             int(time.time()), done)
    return {"id": _record_id(request_id), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}


def failed_record(line: BatchLine, request_id: str, error: Error) -> dict[str, Any]:
    """The error line of a request the worker ended with an `error` event."""
    status, error_type = error_status(error.code)
    return {"id": _record_id(request_id), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id,
                         "body": error_body(error.message, error_type, error.code)},
            "error": None}


def error_record(request_id: str, number: int, custom_id: str | None, code: str,
                 message: str) -> dict[str, Any]:
    """The error line of a line that never produced a response (invalid, or cancelled)."""
    return {"id": _record_id(request_id), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": number}}
