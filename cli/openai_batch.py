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
{code, message, line}.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from llmq.broker.commands import build_submission
from llmq.broker.errors import InvalidRequest
from llmq.broker.protocol import Done, Error

__all__ = ["CHAT", "COMPLETIONS", "BatchLine", "BatchLineError", "error_record",
           "failed_record", "output_record", "parse_line"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_MAX_CUSTOM_ID = 512

# OpenAI body field -> llmq request field
_SAMPLING = {
    "model": "model", "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "priority": "priority",
    "n": "n", "response_format": "response_format",
}
_IGNORED = {"user", "metadata", "store", "service_tier"}  # no effect on the generated text
# Error codes that are the caller's fault get 400, like an API server would answer.
_CLIENT_ERRORS = {"invalid_request", "prompt_too_long", "invalid_token_id"}


class BatchLineError(Exception):
    """A batch input line that cannot run; `custom_id` when it was readable."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


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
        raise BatchLineError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BatchLineError("a batch line is a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > _MAX_CUSTOM_ID:
        raise BatchLineError(f"`custom_id` must be a non-empty string of at most "
                             f"{_MAX_CUSTOM_ID} characters")
    try:
        if obj.get("method", "POST") != "POST":
            raise BatchLineError(f"`method` must be POST, got {obj.get('method')!r}")
        url = obj.get("url")
        if url not in (COMPLETIONS, CHAT):
            raise BatchLineError(f"`url` must be {COMPLETIONS} or {CHAT}, got {url!r}")
        unknown = set(obj) - {"custom_id", "method", "url", "body"}
        if unknown:
            raise BatchLineError(f"unknown field `{sorted(unknown)[0]}`")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BatchLineError("`body` must be a JSON object")
        request = _request(url, body)
        try:
            build_submission(request)  # the worker's own decoder
        except InvalidRequest as exc:
            raise BatchLineError(f"body: {exc}") from None
    except BatchLineError as exc:
        raise BatchLineError(str(exc), custom_id) from None
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return BatchLine(number, custom_id, url, model, request)


def _request(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request: dict[str, Any] = {}
    input_field = "messages" if url == CHAT else "prompt"
    for name, value in body.items():
        if name == "n" and value == 1:
            continue  # the default
        if name in _SAMPLING:
            request[_SAMPLING[name]] = value
        elif name == "max_completion_tokens" and url == CHAT:
            request["max_tokens"] = value
        elif name == "stream":
            if value:
                raise BatchLineError("`stream` must be false in a batch")
        elif name == input_field or name in _IGNORED:
            continue
        else:
            raise BatchLineError(f"body field `{name}` is not supported for {url}")
    if input_field not in body:
        raise BatchLineError(f"body needs `{input_field}` for {url}")
    if url == CHAT:
        request["messages"] = _messages(body["messages"])
    else:
        request.update(_prompt(body["prompt"]))
    return request


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list, as the OpenAI client sends it
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise BatchLineError("`prompt` must be a string or a list of token ids (one prompt per line)")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise BatchLineError("`messages` must be a list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BatchLineError(f"messages[{i}] must be an object")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones carry meaning here
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise BatchLineError(f"messages[{i}]: only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": message.get("role"), "content": content})
    return out


# -- results ---------------------------------------------------------------------------------------


def _record_id(request_id: str) -> str:
    return "batch_req_" + request_id.removeprefix("batch_")


def output_record(line: BatchLine, request_id: str, done: Done, model: str) -> dict[str, Any]:
    """The output line of a request that finished (finish_reason stop or length)."""
    created = int(time.time())
    usage = {"prompt_tokens": done.usage.prompt_tokens,
             "completion_tokens": done.usage.completion_tokens,
             "total_tokens": done.usage.prompt_tokens + done.usage.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": done.usage.cached_prompt_tokens}}
    model = line.model or model
    choices = [(c.index, c.text, c.finish_reason) for c in done.choices] if done.choices else [
        (0, done.text, done.finish_reason)]
    if line.url == CHAT:
        body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
                "model": model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                             "finish_reason": reason, "logprobs": None}
                            for i, text, reason in choices],
                "usage": usage}
    else:
        body = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
                "model": model,
                "choices": [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                            for i, text, reason in choices],
                "usage": usage}
    return {"id": _record_id(request_id), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}


def failed_record(line: BatchLine, request_id: str, error: Error) -> dict[str, Any]:
    """The error line of a request the worker ended with an `error` event."""
    client_error = error.code in _CLIENT_ERRORS
    body = {"error": {"message": error.message,
                      "type": "invalid_request_error" if client_error else "server_error",
                      "param": None, "code": error.code}}
    return {"id": _record_id(request_id), "custom_id": line.custom_id,
            "response": {"status_code": 400 if client_error else 500, "request_id": request_id,
                         "body": body},
            "error": None}


def error_record(request_id: str, number: int, custom_id: str | None, code: str,
                 message: str) -> dict[str, Any]:
    """The error line of a line that never produced a response (invalid, or cancelled)."""
    return {"id": _record_id(request_id), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": number}}
