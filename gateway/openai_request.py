"""OpenAI request bodies -> llmq requests, for the HTTP routes and for batch file lines alike.

`/v1/chat/completions` takes `messages` (string content or text parts), `/v1/completions` takes
`prompt` (one string, or one list of token ids). Sampling fields map onto the llmq request by name
(`max_completion_tokens` is `max_tokens`; vLLM's extras `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `priority` too); `user` and `metadata` ride in the
request's `metadata`. `n` (completions sampled over one prefill) and `response_format` (`text`,
`json_object`, `json_schema`: decoding follows it) pass through as they are. A field llmq cannot
honour (`tools`, `logit_bias`, `best_of`...) is refused, never silently ignored. The whole request
is then checked by the worker's own decoder, so what passes here runs there.

References: https://platform.openai.com/docs/api-reference/chat/create and /completions/create.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmq.broker.commands import build_submission
from llmq.protocol import MAX_LOGPROBS
from llmq.protocol.errors import InvalidRequest

__all__ = ["CHAT", "COMPLETIONS", "BodyError", "OpenAIRequest", "parse_body"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
Endpoint = Literal["/v1/completions", "/v1/chat/completions"]

# OpenAI body field -> llmq request field
_SAMPLING = {
    "model": "model", "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "priority": "priority",
}
# No effect on the generated text.
_IGNORED = {"store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "safety_identifier"}
_EMPTY_OK = {"tools", "functions", "logit_bias"}  # accepted when empty or null
# Passed through as they are, unless they ask for the default.
_PASSED = {"n": 1, "response_format": {"type": "text"}}


class BodyError(Exception):
    """A body llmq cannot run; `param` names the OpenAI field at fault when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OpenAIRequest:
    endpoint: Endpoint
    request: dict[str, Any]  # the llmq request fields, without `id` and `stream`
    model: str | None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: int | None = None  # None: no log-probabilities; n: the sampled token's + top n
    n: int = 1  # completions: the response has choices 0..n-1


def parse_body(endpoint: str, body: Any, *, batch: bool = False) -> OpenAIRequest:
    """Validate one body as the worker will; BodyError saying why not.

    `batch`: a line of a batch file, where `stream`, `logprobs`, `user` and `metadata` have no
    place in the output format: the first two are refused, the others ignored.
    """
    if endpoint not in (COMPLETIONS, CHAT):
        raise BodyError(f"`url` must be {COMPLETIONS} or {CHAT}, got {endpoint!r}")
    if not isinstance(body, dict):
        raise BodyError("the body must be a JSON object")
    chat = endpoint == CHAT
    input_field = "messages" if chat else "prompt"
    request: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for name, value in body.items():
        if name in _SAMPLING:
            request[_SAMPLING[name]] = value
        elif name in _PASSED:
            if value is not None and value != _PASSED[name]:
                request[name] = value
        elif name == "max_completion_tokens" and chat:
            if value is not None:
                request["max_tokens"] = value
        elif name == input_field or name in _IGNORED or (batch and name in ("user", "metadata")):
            continue
        elif name in _EMPTY_OK:
            if value:
                raise BodyError(f"`{name}` is not supported", name)
        else:
            extras[name] = value
    options = _options(endpoint, extras, batch)
    if input_field not in body:
        raise BodyError(f"the body needs `{input_field}` for {endpoint}", input_field)
    if chat:
        request["messages"] = _messages(body["messages"])
    else:
        request.update(_prompt(body["prompt"]))
    if options.pop("_logprobs") is not None:
        request["logprobs"] = options["logprobs"]
    if options["metadata"]:
        request["metadata"] = options["metadata"]
    try:
        build_submission(request)  # the worker's own decoder
    except InvalidRequest as exc:
        raise BodyError(str(exc), _param(str(exc), body)) from None
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return OpenAIRequest(endpoint, request, model, options["stream"], options["include_usage"],
                         options["logprobs"], request.get("n", 1))


def _options(endpoint: str, extras: dict[str, Any], batch: bool) -> dict[str, Any]:
    """The fields that shape the response rather than the request; BodyError for the rest."""
    chat = endpoint == CHAT
    out: dict[str, Any] = {"stream": False, "include_usage": False, "logprobs": None,
                           "_logprobs": None, "metadata": {}}
    for name, value in extras.items():
        if name == "stream":
            if value and batch:
                raise BodyError("`stream` must be false in a batch", "stream")
            out["stream"] = bool(value)
        elif name == "stream_options" and not batch:
            if value is not None and not isinstance(value, dict):
                raise BodyError("`stream_options` must be an object", "stream_options")
            out["include_usage"] = bool((value or {}).get("include_usage"))
        elif name == "logprobs" and not batch:
            if chat:
                if value not in (None, True, False):
                    raise BodyError("`logprobs` must be a boolean", "logprobs")
                out["_logprobs"] = True if value else None
            elif value is not None:
                out["_logprobs"] = out["logprobs"] = _count("logprobs", value)
        elif name == "top_logprobs" and chat and not batch:
            if value is not None:
                out["logprobs"] = _count("top_logprobs", value)
        elif name in ("user", "metadata"):
            if value is not None:
                if name == "metadata" and not isinstance(value, dict):
                    raise BodyError("`metadata` must be an object", "metadata")
                out["metadata"][name] = value
        elif name == "tool_choice" and not batch:
            if value not in (None, "none", "auto"):
                raise BodyError("`tool_choice` is not supported", "tool_choice")
        elif name in ("echo", "best_of", "suffix") and not chat and not batch:
            harmless = {"echo": False, "best_of": 1, "suffix": ""}[name]
            if value is not None and (value != harmless or type(value) is not type(harmless)):
                raise BodyError(f"`{name}` is not supported", name)
        else:
            raise BodyError(f"body field `{name}` is not supported for {endpoint}", name)
    if chat and out["_logprobs"]:
        out["logprobs"] = out["logprobs"] or 0
    elif chat and out["logprobs"] is not None:
        raise BodyError("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    if out["include_usage"] and not out["stream"]:
        raise BodyError("`stream_options` is only allowed with `stream: true`", "stream_options")
    return out


def _count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BodyError(f"`{name}` must be an integer from 0 to {MAX_LOGPROBS}", name)
    return value


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list, as the OpenAI client sends it
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise BodyError("`prompt` must be a string or a list of token ids (one prompt per line)",
                    "prompt")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise BodyError("`messages` must be a list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BodyError(f"messages[{i}] must be an object", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones carry meaning here
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise BodyError(f"messages[{i}]: only text content parts are supported",
                                    f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": message.get("role"), "content": content})
    return out


def _param(message: str, body: dict[str, Any]) -> str | None:
    """The OpenAI name of the field a decoder message points at (``... - at `$.top_p```)."""
    _, found, path = message.rpartition("at `$.")
    if not found:
        return None
    field = path.rstrip("`")
    if field.startswith("max_tokens") and "max_completion_tokens" in body:
        return "max_completion_tokens"
    if field.startswith("prompt_token_ids"):
        return "prompt"
    return field
