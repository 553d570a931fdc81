"""llmq events -> OpenAI response objects and stream chunks, without IO.

`completion_object()` is a whole `chat.completion` / `text_completion` (HTTP answers and batch
output lines); `CompletionStream` turns a request's followed events into server-sent events, each
carrying `id: <result stream entry id>` so a client can resume after any of them
(`Last-Event-ID`). Usage, finish reasons and logprobs have OpenAI's shapes. A request with n > 1
has choices 0..n-1: its deltas carry their `index`, its `done` lists every choice, and each
stream chunk carries the choices it concerns, by index.

Two things llmq knows that OpenAI's format has no word for:
- a request that ran again on another worker (attempt 2 after a crash): its new text is checked
  against what the client already has, and only what extends it is sent; a sampled rerun that
  differs ends the stream with an error instead of sending text that contradicts the old;
- token strings: the gateway has no tokenizer; the worker names each token of a logprob (its
  text, or vLLM's `bytes:\\xNN` form for part of a character: protocol/token_text.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmq.broker.commands import Followed
from llmq.broker.transcript import Fold
from llmq.gateway.openai_request import CHAT
from llmq.gateway.tool_calls import parse_tool_calls, streamable_length, tool_call_id
from llmq.protocol import Delta, Done, Error, Start, TokenLogprob, Usage
from llmq.protocol.token_text import token_bytes

__all__ = ["DONE_FRAME", "CompletionStream", "LogprobsBuilder", "completion_id",
           "completion_object", "error_body", "error_status", "merge_completions",
           "prompt_logprobs_object", "sse",
           "tool_call_objects",
           "usage_object"]

_json = msgspec.json.Encoder()
_NEG_INF = -9999.0  # what OpenAI reports for a log-probability of -inf
# Error codes that are the caller's fault get 400, like an API server would answer.
_CLIENT_ERRORS = {"invalid_request", "prompt_too_long", "invalid_token_id"}
_STATUS = {"deadline_exceeded": 504, "timeout": 504, "cancelled": 409}
DONE_FRAME = b"data: [DONE]\n\n"


def completion_id(endpoint: str, public_id: str) -> str:
    return f"chatcmpl-{public_id}" if endpoint == CHAT else f"cmpl-{public_id}"


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def completion_object(endpoint: str, object_id: str, model: str, created: int, done: Done,
                      logprobs: Mapping[int, Any] | None = None, *,
                      tool_calls: bool = False, echo: str = "") -> dict[str, Any]:
    """A whole `chat.completion` or `text_completion` object for a finished request: one choice,
    or with n > 1 every one by index. `logprobs`: each choice's, by index. `tool_calls`: read
    each choice's text as tool calls when it is written as some (gateway/tool_calls.py).
    `echo`: the prompt, which begins each completion's text."""
    completions = ([(c.index, c.text, c.finish_reason) for c in done.choices] if done.choices
                   else [(0, done.text, done.finish_reason)])
    chat = endpoint == CHAT
    choices = []
    for index, text, reason in completions:
        finish_reason: str = reason
        choice: dict[str, Any] = {"index": index}
        calls = parse_tool_calls(text) if chat and tool_calls else None
        if calls is not None:
            content, parsed = calls
            choice["message"] = {"role": "assistant", "content": content,
                                 "tool_calls": tool_call_objects(object_id, index, parsed)}
            finish_reason = "tool_calls"
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = echo + text
        choice.update(finish_reason=finish_reason, logprobs=(logprobs or {}).get(index))
        if not chat and done.prompt_logprobs is not None:  # vLLM's place for them
            choice["prompt_logprobs"] = prompt_logprobs_object(done.prompt_logprobs)
        choices.append(choice)
    whole = {"id": object_id, "object": "chat.completion" if chat else "text_completion",
             "created": created, "model": model, "choices": choices,
             "usage": usage_object(done.usage)}
    if chat and done.prompt_logprobs is not None:
        whole["prompt_logprobs"] = prompt_logprobs_object(done.prompt_logprobs)
    return whole


def prompt_logprobs_object(entries: list[TokenLogprob | None]) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {"logprob",
    "rank", "decoded_token"}} for the token itself and the most likely ones there."""
    shaped: list[Any] = []
    for entry in entries:
        if entry is None:
            shaped.append(None)
            continue
        names: list[str | None] = [*entry.top_tokens] or [None] * len(entry.top_token_ids)
        position = {str(t): {"logprob": _finite(v), "rank": rank, "decoded_token": name}
                    for rank, (t, v, name) in enumerate(zip(
                        entry.top_token_ids, entry.top_logprobs, names, strict=False), 1)}
        position.setdefault(str(entry.token_id), {"logprob": _finite(entry.logprob),
                                                  "rank": entry.rank,
                                                  "decoded_token": entry.token})
        shaped.append(position)
    return shaped


def tool_call_objects(object_id: str, choice: int, calls: list[tuple[str, str]],
                      streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` of (name, arguments) pairs; in a stream each carries its index."""
    objects = []
    for i, (name, arguments) in enumerate(calls):
        call: dict[str, Any] = {"id": tool_call_id(object_id, choice, i), "type": "function",
                                "function": {"name": name, "arguments": arguments}}
        objects.append({"index": i, **call} if streamed else call)
    return objects


def merge_completions(answers: list[tuple[int, Any]], n: int) -> tuple[int, Any]:
    """One `text_completion` of several prompts' (status, body): the first failure as it is,
    else prompt k's choice j at index k * n + j and the usage summed."""
    for status, body in answers:
        if status != 200:
            return status, body
    merged = {**answers[0][1], "choices": []}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for k, (_, body) in enumerate(answers):
        merged["choices"] += [{**c, "index": k * n + c["index"]} for c in body["choices"]]
        for name in usage:
            usage[name] += body["usage"][name]
    merged["usage"] = {**usage, "prompt_tokens_details": {"cached_tokens": sum(
        b["usage"]["prompt_tokens_details"]["cached_tokens"] for _, b in answers)}}
    return 200, merged


def error_status(code: str) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of an llmq error code."""
    if code in _CLIENT_ERRORS:
        return 400, "invalid_request_error"
    return _STATUS.get(code, 500), "server_error"


def error_body(message: str, error_type: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse(data: Any, event_id: str | None = None) -> bytes:
    """One server-sent event: `id:` (when given) and a JSON `data:` line."""
    head = b"" if event_id is None else b"id: " + event_id.encode() + b"\n"
    payload = _json.encode(data)
    if b"\xe2\x80\xa8" in payload or b"\xe2\x80\xa9" in payload or b"\xc2\x85" in payload:
        # NOTE: U+2028, U+2029 and U+0085 are valid raw in JSON, but line readers built on
        # str.splitlines() (httpx's aiter_lines among them) would cut the event there.
        payload = (payload.replace(b"\xe2\x80\xa8", b"\\u2028")
                   .replace(b"\xe2\x80\xa9", b"\\u2029").replace(b"\xc2\x85", b"\\u0085"))
    return head + b"data: " + payload + b"\n\n"


class LogprobsBuilder:
    """Log-probabilities of the tokens sent so far, in the endpoint's OpenAI shape."""

    def __init__(self, endpoint: str) -> None:
        self.chat = endpoint == CHAT
        self.content: list[dict[str, Any]] = []  # chat: one entry per token
        self.tokens: list[str] = []  # completions: four parallel lists
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []
        self._offset = 0
        self._taken = 0

    def add(self, text: str, token_logprobs: list[TokenLogprob]) -> None:
        """Fold in one delta's logprobs: each token with its own text when the worker named it
        (else the delta's text goes with its last token, and alternatives are `token_id:<id>`,
        vLLM's `return_tokens_as_token_ids`)."""
        for i, lp in enumerate(token_logprobs):
            if lp.token is not None:
                token = lp.token
            else:
                token = text if i == len(token_logprobs) - 1 else ""
            names = lp.top_tokens or [f"token_id:{t}" for t in lp.top_token_ids]
            logprob = _finite(lp.logprob)
            top = [(t, _finite(v)) for t, v in zip(names, lp.top_logprobs, strict=False)]
            if self.chat:
                self.content.append({
                    "token": token, "logprob": logprob, "bytes": list(token_bytes(token)),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(token_bytes(t))}
                                     for t, v in top]})
            else:
                self.tokens.append(token)
                self.token_logprobs.append(logprob)
                self.top_logprobs.append(dict(top))
                self.text_offset.append(self._offset)
            self._offset += len(token_bytes(token).decode(errors="replace")) if lp.token \
                is not None else len(token)

    def take(self) -> Any:
        """The logprobs added since the last take (for the next chunk); None if there are none."""
        first, self._taken = self._taken, len(self.content) if self.chat else len(self.tokens)
        return None if first == self._taken else self._shape(first)

    def result(self) -> Any:
        return self._shape(0)

    def _shape(self, first: int) -> Any:
        if self.chat:
            return {"content": self.content[first:], "refusal": None}
        return {"tokens": self.tokens[first:], "token_logprobs": self.token_logprobs[first:],
                "top_logprobs": self.top_logprobs[first:], "text_offset": self.text_offset[first:]}


def _finite(value: float | None) -> float:
    return _NEG_INF if value is None else max(value, _NEG_INF)


@dataclass
class _ChoiceStream:
    """What one of the n choices has sent, and where its current attempt stands."""

    sent: str = ""  # the text the client has
    attempt_text: str = ""
    rerun: bool = False  # a newer attempt that has not yet passed the text already sent
    builder: LogprobsBuilder | None = None


@dataclass
class CompletionStream:
    """One request's events as OpenAI stream chunks (SSE frames), resumable by entry id.

    Feed every followed event, replayed ones included (they rebuild the state and send nothing),
    so a stream resumed on another gateway continues exactly where the client left off.
    """

    endpoint: str
    public_id: str
    model: str = ""  # the requested model, until the worker's `start` names the one it serves
    include_usage: bool = False
    logprobs: bool = False
    n: int = 1  # choices 0..n-1
    tool_calls: bool = False  # read the output as tool calls (chat): hold back what may be one
    continuous_usage: bool = False  # usage on every chunk (vLLM's continuous_usage_stats)
    echo: str = ""  # completions: the prompt, sent first as each choice's text
    created: int = 0
    finished: bool = False
    _role_sent: bool = False
    _usage: list[int] = field(default_factory=lambda: [0, 0])  # the attempt's prompt, output
    _choices: list[_ChoiceStream] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.object_id = completion_id(self.endpoint, self.public_id)
        self.chat = self.endpoint == CHAT
        self._choices = [_ChoiceStream() for _ in range(self.n)]

    def feed(self, followed: Followed) -> list[bytes]:
        frames = self._frames(followed)
        if not followed.replayed:
            return frames
        # NOTE: the end of a stream is several frames and only the first carries the entry id:
        # a client resuming after it still needs the rest (usage, [DONE]).
        return frames[1:] if self.finished and frames else []

    def _frames(self, followed: Followed) -> list[bytes]:
        event, entry_id = followed.event, followed.entry_id
        if not self.created:
            self.created = int(entry_id.partition("-")[0]) // 1000
        if followed.fold is Fold.RESTARTED:
            for choice in self._choices:
                choice.attempt_text, choice.rerun = "", True
        if isinstance(event, Start):
            self.model = event.model or self.model
            self._usage = [event.prompt_tokens, 0]
            if self._role_sent:
                return []
            self._role_sent = True
            if not self.chat:
                return [sse(self._chunk([(i, self.echo, None, None) for i in range(self.n)]),
                            entry_id)] if self.echo else []
            return [sse(self._chunk([(i, {"role": "assistant", "content": ""}, None, None)
                                     for i in range(self.n)]), entry_id)]
        if self.finished:
            return []
        if isinstance(event, Delta):
            if not 0 <= event.index < self.n:
                return []  # not a choice this stream was asked for
            choice = self._choices[event.index]
            choice.attempt_text += event.text
            self._usage[1] += len(event.token_ids)
            text = choice.attempt_text
            if self.tool_calls:  # NOTE: a call is sent whole at the end, as `tool_calls`
                text = text[:streamable_length(text)]
            return self._extend(event.index, text, entry_id, event)
        if isinstance(event, Error):
            self.finished = True
            _, kind = error_status(event.code)
            return [sse(error_body(event.message, kind, event.code), entry_id), DONE_FRAME]
        assert isinstance(event, Done)
        if event.finish_reason == "cancelled":
            self.finished = True
            return [sse(error_body("the request was cancelled", "server_error", "cancelled"),
                        entry_id), DONE_FRAME]
        ends = ([(c.index, c.text, c.finish_reason) for c in event.choices if c.index < self.n]
                if event.choices else [(0, event.text, event.finish_reason)])
        frames: list[bytes] = []
        reasons: dict[int, str] = {}
        for index, text, finish_reason in ends:
            reason: str = finish_reason
            calls = parse_tool_calls(text) if self.tool_calls else None
            if calls is not None:  # what was held back is calls: send them, not their text
                text, reason = text[:streamable_length(text)], "tool_calls"
            # NOTE: only the first frame of the end carries the entry id (see `feed`).
            frames += self._extend(index, text, None if frames else entry_id, None)
            if self.finished:  # the rerun diverged
                return frames
            if calls is not None:
                deltas = tool_call_objects(self.object_id, index, calls[1], streamed=True)
                frames.append(sse(self._chunk([(index, {"tool_calls": deltas}, None, None)]),
                                  None if frames else entry_id))
            reasons[index] = reason
        self.finished = True
        final = self._chunk([(index, {} if self.chat else "", reasons[index],
                              self._take_logprobs(index)) for index, _, _ in ends])
        frames.append(sse(final, None if frames else entry_id))
        if self.include_usage:
            usage = {"id": self.object_id, "object": self._object(), "created": self.created,
                     "model": self.model, "choices": [], "usage": usage_object(event.usage)}
            frames.append(sse(usage))
        frames.append(DONE_FRAME)
        return frames

    def _extend(self, index: int, text: str, entry_id: str | None,
                delta: Delta | None) -> list[bytes]:
        """Send what `text` (the attempt's text so far) adds to what the client has of choice
        `index`."""
        choice = self._choices[index]
        catching_up = len(text) <= len(choice.sent) and choice.sent.startswith(text)
        # NOTE: a rerun's tokens that re-cover sent text were already reported with the text.
        if self.logprobs and delta is not None and delta.logprobs and not (
                choice.rerun and catching_up):
            choice.builder = choice.builder or LogprobsBuilder(self.endpoint)
            choice.builder.add(delta.text, delta.logprobs)
        if catching_up:
            return []  # no new text: an empty delta, or a rerun catching up with the sent text
        if not text.startswith(choice.sent):
            self.finished = True
            message = ("the request ran again on another worker and its new output differs "
                       "from the text already streamed; send it again")
            return [sse(error_body(message, "server_error", "restart_diverged"), entry_id),
                    DONE_FRAME]
        new, choice.sent, choice.rerun = text[len(choice.sent):], text, False
        content = {"content": new} if self.chat else new
        return [sse(self._chunk([(index, content, None, self._take_logprobs(index))]),
                    entry_id)]

    def _take_logprobs(self, index: int) -> Any:
        builder = self._choices[index].builder
        return None if builder is None else builder.take()

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choices: list[tuple[int, Any, str | None, Any]]) -> dict[str, Any]:
        """A chunk carrying (index, content, finish_reason, logprobs) for each choice given."""
        key = "delta" if self.chat else "text"
        chunk = {"id": self.object_id, "object": self._object(), "created": self.created,
                 "model": self.model,
                 "choices": [{"index": index, key: content, "logprobs": logprobs,
                              "finish_reason": finish_reason}
                             for index, content, finish_reason, logprobs in choices]}
        if self.include_usage:
            chunk["usage"] = None
        if self.continuous_usage:
            prompt, completion = self._usage
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        return chunk
