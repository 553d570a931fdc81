"""Routes answered from a prompt alone: embeddings, tokenize, detokenize.

    POST /v1/embeddings   OpenAI's: `input` a string, strings, token ids, or lists of ids
                          (or vLLM's chat `messages`); `encoding_format` float or base64
    POST /tokenize        vLLM's: `prompt` or chat `messages` -> `count`, `max_model_len`,
                          `tokens` (and `token_strs` with `return_token_strs`)
    POST /detokenize      vLLM's: `tokens` -> `prompt`

Each is an ordinary request on the model's queue with a `task` (docs/protocol.md): delivery,
reclaim, tenants and cancels work as for a completion, and a producer that may submit can ask
nothing more of a worker than it could before (the control stream stays admin-only). The worker
that takes one answers with a single `done` carrying the vector, the ids or the text
(worker/engine/prompt_tasks.py); the gateway never loads a tokenizer or a model itself.

An embeddings body of several inputs is one request per input (`<id>.<k>`), answered together.

References: https://platform.openai.com/docs/api-reference/embeddings/create; vLLM's
entrypoints/openai/protocol.py (`EmbeddingCompletionRequest`, `TokenizeCompletionRequest`,
`TokenizeChatRequest`, `DetokenizeRequest`).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.commands import build_submission
from llmq.broker.multiplex import parse_entry_id
from llmq.gateway.errors import APIError, bad_request
from llmq.gateway.following import (
    GONE,
    following,
    openai_code,
    timeout_body,
    unless_client_gone,
)
from llmq.gateway.openai_request import (
    BodyError,
    ChatMessage,
    Prompt,
    llmq_message,
    llmq_prompts,
)
from llmq.gateway.openai_response import error_status
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol import Done, Error, Start
from llmq.protocol.errors import InvalidRequest, LLMQError, ResultTimeout

__all__ = ["create_embeddings", "detokenize", "tokenize"]

MAX_INPUTS = 2048  # OpenAI's bound on one embeddings body's inputs


class EmbeddingsBody(Struct, kw_only=True, forbid_unknown_fields=True):
    input: Prompt | None = None  # a string, token ids, or a list of either
    messages: list[ChatMessage] | None = None  # vLLM's: one conversation, chat-templated
    add_generation_prompt: bool | None = None  # with messages; false by default, as vLLM's
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None  # refused: llmq's vectors have the model's width
    user: str | None = None
    add_special_tokens: bool | None = None  # vLLM's: false adds no BOS to string inputs


class TokenizeBody(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt only: a chat template writes its own
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: bool | None = None


@dataclass(frozen=True)
class _Answer:
    done: Done
    model: str  # what the worker serves (its `start`)
    created: int  # unix seconds of the answer


class DetokenizeBody(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


async def create_embeddings(request: Request) -> Response:
    """POST /v1/embeddings: the input's embeddings (pooled as the model says, unit length)."""
    body = _decode(EmbeddingsBody, await request.body())
    if body.dimensions is not None:
        raise bad_request("`dimensions` is not supported: the vectors have the model's width",
                          "dimensions")
    if (body.input is None) == (body.messages is None):
        raise bad_request("give exactly one of `input` and `messages`", "input")
    try:
        prompts = _embedding_prompts(body)
    except BodyError as exc:
        raise bad_request(str(exc), exc.param) from None
    if len(prompts) > MAX_INPUTS:
        raise bad_request(f"`input` has {len(prompts)} items, at most {MAX_INPUTS} allowed",
                          "input")
    extra = {"add_special_tokens": False} if body.add_special_tokens is False else {}
    requests = [{**prompt, "task": "embed", "model": body.model,
                 **(extra if "prompt" in prompt else {})} for prompt in prompts]
    answers = await _run(request, body.model, requests, "input")
    data = [{"object": "embedding", "index": k,
             "embedding": _encoded(a.done.embedding or [], body.encoding_format)}
            for k, a in enumerate(answers)]
    prompt_tokens = sum(a.done.usage.prompt_tokens for a in answers)
    return json_response({"id": f"embd-{request.state.request_id}", "object": "list",
                          "created": min(a.created for a in answers),
                          "model": answers[0].model or body.model or "", "data": data,
                          "usage": {"prompt_tokens": prompt_tokens,
                                    "total_tokens": prompt_tokens}})


def _embedding_prompts(body: EmbeddingsBody) -> list[dict[str, Any]]:
    """The llmq prompt fields of each input (one conversation is one input)."""
    if body.messages is not None:
        return [{"messages": [llmq_message(i, m) for i, m in enumerate(body.messages)],
                 "add_generation_prompt": bool(body.add_generation_prompt),
                 "chat_template_kwargs": body.chat_template_kwargs}]
    try:
        return llmq_prompts(body.input or "")
    except BodyError:
        raise BodyError("`input` must be a string, a list of token ids, or a non-empty list of "
                        "either", "input") from None


async def tokenize(request: Request) -> Response:
    """POST /tokenize: the token ids of a prompt or of chat messages (vLLM's)."""
    body = _decode(TokenizeBody, await request.body())
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
    fields: dict[str, Any] = {"task": "tokenize", "model": body.model}
    if body.messages is not None:
        if body.add_special_tokens:
            raise bad_request("`add_special_tokens` applies to `prompt` only: a chat template "
                              "writes its own special tokens", "add_special_tokens")
        try:
            fields["messages"] = [llmq_message(i, m) for i, m in enumerate(body.messages)]
        except BodyError as exc:
            raise bad_request(str(exc), exc.param) from None
        fields.update(tools=body.tools or None, chat_template_kwargs=body.chat_template_kwargs,
                      add_generation_prompt=body.add_generation_prompt,
                      continue_final_message=body.continue_final_message)
    else:
        fields.update(prompt=body.prompt, add_special_tokens=body.add_special_tokens)
    (answer,) = await _run(request, body.model, [fields], None)
    tokens = answer.done.tokens
    if tokens is None:
        raise APIError(502, "the worker answered without tokens: is it older than this "
                       "gateway?", "server_error", code="worker_too_old")
    return json_response({"count": len(tokens.token_ids), "max_model_len": tokens.max_model_len,
                          "tokens": tokens.token_ids,
                          "token_strs": tokens.token_strs if body.return_token_strs else None})


async def detokenize(request: Request) -> Response:
    """POST /detokenize: the text of token ids (vLLM's)."""
    body = _decode(DetokenizeBody, await request.body())
    if not body.tokens:
        raise bad_request("`tokens` must not be empty", "tokens")
    (answer,) = await _run(request, body.model, [
        {"task": "detokenize", "model": body.model, "prompt_token_ids": body.tokens}], "tokens")
    return json_response({"prompt": answer.done.text})


def _decode(kind: type[Any], raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        _, found, path = message.rpartition(" - at `$.")
        raise bad_request(message, path.removesuffix("`") if found else None) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None


async def _run(request: Request, model: str | None, requests: list[dict[str, Any]],
               param: str | None) -> list[_Answer]:
    """Submit the requests (checked by the worker's own decoder first) and wait for every
    `done`, in order; APIError for the first failure."""
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    public_id = request.state.request_id = uuid.uuid4().hex
    for k, fields in enumerate(requests):
        try:
            build_submission(fields)
        except InvalidRequest as exc:
            where = f"{param}[{k}]: " if param and len(requests) > 1 else ""
            raise bad_request(f"{where}{exc}", param) from None
    queue = await state.pool.route(model)
    ids = [f"{tenant}:{public_id}" + (f".{k}" if len(requests) > 1 else "")
           for k in range(len(requests))]
    await asyncio.gather(*(state.client.submit(request_id=i, queue=queue, stream=False, **r)
                           for i, r in zip(ids, requests, strict=True)))
    answers = await unless_client_gone(request, asyncio.gather(
        *(_answer(state, i) for i in ids)))
    if answers is GONE or not isinstance(answers, list):
        for request_id in ids:
            await state.cancel(request_id, queue)
        raise APIError(499, "the client went away", "invalid_request_error")
    for outcome in answers:
        if isinstance(outcome, APIError):
            raise outcome
    return [a for a in answers if isinstance(a, _Answer)]


async def _answer(state: GatewayState, request_id: str) -> _Answer | APIError:
    """A request's `done`, or the APIError it ended with."""
    served = ""
    try:
        async with following(state, request_id) as events:
            async for followed in events:
                event = followed.event
                if isinstance(event, Start):
                    served = event.model
                elif isinstance(event, Done):
                    if event.finish_reason == "cancelled":
                        return APIError(409, "the request was cancelled", "server_error",
                                        code="cancelled")
                    return _Answer(event, served, parse_entry_id(followed.entry_id)[0] // 1000)
                elif isinstance(event, Error):
                    status, kind = error_status(event.code)
                    return APIError(status, event.message, kind, code=openai_code(event.code))
    except ResultTimeout:
        body = timeout_body(state)["error"]
        return APIError(504, body["message"], body["type"], code=body["code"])
    except LLMQError as exc:
        return APIError(503, str(exc), "server_error", code="broker_unavailable")
    raise AssertionError("follow() ends only after a terminal event")


def _encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32s."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector

