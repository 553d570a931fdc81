"""POST /v1/responses: OpenAI's Responses API over the chat path, whole or as typed events.

A body becomes a chat request and is checked as one (gateway/openai_request.py): `input` (a
string, or message, `function_call` and `function_call_output` items) the messages,
`instructions` a system message, `max_output_tokens` `max_tokens`, `text.format` the
`response_format`, `tools` (`{"type": "function", "name": ...}`) and `tool_choice` the chat
ones. `previous_response_id` continues a conversation: each finished response keeps its whole
conversation (input and output, not its instructions, as OpenAI does) in Redis beside its
request's stream options, for as long as results are kept (`result_ttl`); another tenant's id
is unknown.

A streamed response is server-sent events typed as OpenAI's (`response.created`,
`response.output_text.delta`, ..., `response.completed`), its HTTP status waiting for the
worker's admission as the chat streams do (gateway/completions.py).

Reference: https://platform.openai.com/docs/api-reference/responses/create and its streaming
events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmq.broker.commands import Followed
from llmq.gateway.errors import bad_request, not_found
from llmq.gateway.following import admission, openai_code
from llmq.gateway.openai_request import CHAT, BodyError, parse_body
from llmq.gateway.openai_response import error_body, error_status
from llmq.gateway.responses_shape import ResponseShape, response_event
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol import Done, Error, Start
from llmq.protocol.errors import LLMQError, ResultTimeout
from llmq.protocol.names import is_valid_name

__all__ = ["create_response", "get_response"]

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_json = msgspec.json.Encoder()


class ContentPart(Struct, kw_only=True):
    type: str  # input_text, output_text (text parts only)
    text: str | None = None


class InputItem(Struct, kw_only=True):
    """A message (`type` message or absent), a `function_call`, or a `function_call_output`."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None
    status: str | None = None


class TextFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # text, json_object, json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(Struct, kw_only=True):
    format: TextFormat | None = None


class FunctionTool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesBody(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # accepted, with no effect
    store: bool | None = None
    truncation: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None


_decoder = msgspec.json.Decoder(ResponsesBody)


async def create_response(request: Request) -> Response:
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    try:
        body = _decoder.decode(await request.body())
    except msgspec.ValidationError as exc:
        raise bad_request(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        kept = await _load(state, tenant, body.previous_response_id)
        if kept is None:
            raise not_found(f"Previous response with id {body.previous_response_id!r} not found "
                            "(unknown, another key's, or expired)")
        history = kept
    messages = history + _messages(body.input)
    try:
        parsed = parse_body(CHAT, _chat_body(body, messages))
    except BodyError as exc:
        raise bad_request(str(exc), exc.param) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    request.state.request_id = response_id
    request_id = f"{tenant}:{response_id}"
    queue = await state.pool.route(parsed.model)
    await state.client.submit(request_id=request_id, queue=queue, stream=bool(body.stream),
                              **parsed.request)
    shape = ResponseShape(response_id, parsed.model or "", int(time.time()), _echo(body),
                          parsed.tool_calls)
    events = state.client.follow(request_id, timeout=state.settings.request_timeout)
    if body.stream:
        admitted = await admission(state, request, request_id, queue, False, events)
        if isinstance(admitted, Response):
            if isinstance(events, AsyncGenerator):
                await events.aclose()
            return admitted
        return StreamingResponse(
            _stream(state, tenant, request_id, queue, shape, messages, events, admitted),
            headers=_SSE_HEADERS, media_type="text/event-stream")
    try:
        async for followed in events:
            event = followed.event
            if isinstance(event, Start):
                shape.model = event.model or shape.model
            elif isinstance(event, Error):
                status, kind = error_status(event.code)
                return json_response(error_body(event.message, kind, openai_code(event.code)),
                                     status)
            elif isinstance(event, Done):
                answer = shape.finish(event)
                await _keep(state, tenant, shape, messages)
                return json_response(answer)
    except ResultTimeout:
        await state.cancel(request_id, queue)
        return json_response(error_body("no answer within the gateway's request timeout",
                                        "server_error", "timeout"), 504)
    except LLMQError as exc:
        return json_response(error_body(str(exc), "server_error", "broker_unavailable"), 503)
    finally:
        if isinstance(events, AsyncGenerator):
            await events.aclose()
    raise AssertionError("follow() ends only after a terminal event")


async def get_response(request: Request) -> Response:
    """GET /v1/responses/{id}: a finished response of this tenant's, as it was answered."""
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    response_id = request.path_params["response_id"]
    kept = await _kept(state, tenant, response_id, "response")
    if kept is None:
        raise not_found(f"Response with id {response_id!r} not found")
    return json_response(kept)


async def _stream(state: GatewayState, tenant: str, request_id: str, queue: str,
                  shape: ResponseShape, messages: list[dict[str, Any]],
                  events: AsyncIterator[Followed], read: list[Followed]
                  ) -> AsyncGenerator[bytes, None]:
    finished = False
    try:
        yield response_event(shape.created())
        for followed in read:
            for payload in shape.feed(followed.event):
                yield response_event(payload)
        if not shape.done:
            async for followed in events:
                for payload in shape.feed(followed.event):
                    yield response_event(payload)
                if shape.done:
                    break
        finished = True
        if shape.failed is None:
            await _keep(state, tenant, shape, messages)
    except ResultTimeout:
        finished = True
        yield response_event(shape.fail("timeout", "no answer within the gateway's request "
                                        "timeout"))
    finally:
        if isinstance(events, AsyncGenerator):
            await events.aclose()
        if not finished and not state.shutting_down():
            await state.cancel(request_id, queue)


# -- the body as chat -----------------------------------------------------------------------------


def _messages(given: str | list[InputItem]) -> list[dict[str, Any]]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(given):
        if item.type == "message":
            content = item.content
            if isinstance(content, list):
                content = "".join(part.text or "" for part in content)
            messages.append({"role": item.role or "user", "content": content})
        elif item.type == "function_call":
            call = {"id": item.call_id or item.id or f"call_{index}", "type": "function",
                    "function": {"name": item.name or "", "arguments": item.arguments or "{}"}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get(
                    "tool_calls"):
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id or "",
                             "content": item.output or ""})
        else:
            raise bad_request(f"input[{index}]: items of type {item.type!r} are not supported "
                              "(message, function_call, function_call_output)",
                              f"input[{index}].type")
    return messages


def _chat_body(body: ResponsesBody, messages: list[dict[str, Any]]) -> dict[str, Any]:
    chat: dict[str, Any] = {
        "model": body.model, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
        "messages": ([{"role": "system", "content": body.instructions}] if body.instructions
                     else []) + messages}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema or {}}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    return {name: value for name, value in chat.items() if value is not None}


def _echo(body: ResponsesBody) -> dict[str, Any]:
    """The request's settings, as a response object repeats them."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto", "metadata": body.metadata or {},
            "tools": msgspec.to_builtins(body.tools or []),
            "text": {"format": msgspec.to_builtins(body.text.format) if body.text is not None
                     and body.text.format is not None else {"type": "text"}}}


# -- the conversations kept -----------------------------------------------------------------------


async def _keep(state: GatewayState, tenant: str, shape: ResponseShape,
                messages: list[dict[str, Any]]) -> None:
    """A finished response: its object, and its conversation to continue from."""
    # NOTE: beside the request's stream options, so it is the tenant's alone, expires with the
    # results, and needs no key the gateway's Redis user lacks (deploy/acl.conf).
    await state.remember_stream(f"{tenant}:{shape.response_id}", {
        "conversation": _json.encode(messages + [shape.assistant_turn()]),
        "response": _json.encode(shape.final)})


async def _load(state: GatewayState, tenant: str, response_id: str
                ) -> list[dict[str, Any]] | None:
    """The conversation of a finished response of this tenant's; None if there is none."""
    return await _kept(state, tenant, response_id, "conversation")


async def _kept(state: GatewayState, tenant: str, response_id: str, what: str) -> Any:
    if not response_id.startswith("resp_") or not is_valid_name(response_id) or len(
            response_id) > 64:
        return None
    options = await state.stream_options(f"{tenant}:{response_id}")
    kept = None if options is None else options.get(what)
    return None if kept is None else msgspec.json.decode(kept)
