"""llmq events -> OpenAI Responses API objects and stream events, without IO.

`ResponseShape` follows one request: `feed` turns each event into the stream's typed events
(`response.output_item.added`, `response.output_text.delta`, ..., `response.completed`, each
with its `sequence_number`), `finish` gives the whole `response` object. Output is one
`message` item with one `output_text` part, and, when the text is tool calls
(gateway/tool_calls.py), one `function_call` item per call after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmq.gateway.tool_calls import parse_tool_calls, streamable_length, tool_call_id
from llmq.protocol import Delta, Done, Error, Event, Start, Usage

__all__ = ["ResponseShape", "response_event"]

_json = msgspec.json.Encoder()


def response_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event named by its `type`, as OpenAI streams them."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


@dataclass
class ResponseShape:
    response_id: str
    model: str
    created_at: int
    echo: dict[str, Any]  # the request's settings the response object repeats
    tool_calls: bool = False  # read the output as tool calls
    text: str = ""  # the attempt's text so far
    sent: str = ""  # the text streamed so far
    done: bool = False
    failed: dict[str, Any] | None = None
    final: dict[str, Any] = field(default_factory=dict)  # the response object, once done
    _sequence: int = 0
    _opened: bool = False
    _calls: list[tuple[str, str]] = field(default_factory=list)
    _content: str | None = None

    @property
    def message_id(self) -> str:
        return "msg_" + self.response_id.removeprefix("resp_")

    def created(self) -> dict[str, Any]:
        return self._event("response.created", response=self._object("in_progress", [], None))

    def feed(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, Start):
            self.model, self.text = event.model or self.model, ""
            return []
        if isinstance(event, Delta) and event.index == 0 and not self.done:
            self.text += event.text
            return self._send(self.text)
        if isinstance(event, Error):
            return [self.fail(event.code, event.message)]
        if isinstance(event, Done):
            if event.finish_reason == "cancelled":
                return [self.fail("cancelled", "the request was cancelled")]
            return self._end(event)
        return []

    def fail(self, code: str, message: str) -> dict[str, Any]:
        self.done, self.failed = True, {"code": code, "message": message}
        return self._event("response.failed", response=self._object("failed", [], None))

    def finish(self, done: Done) -> dict[str, Any]:
        """The whole response object of a finished request."""
        self._end(done)
        return self.final

    def assistant_turn(self) -> dict[str, Any]:
        """The answer as a chat message, for the conversation kept."""
        if not self._calls:
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": self._content, "tool_calls": [
            {"id": tool_call_id(self.response_id, 0, i), "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(self._calls)]}

    # -- the stream -------------------------------------------------------------------------------

    def _send(self, text: str) -> list[dict[str, Any]]:
        if self.tool_calls:
            text = text[:streamable_length(text)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return []
        delta, self.sent = text[len(self.sent):], text
        return [*self._open(), self._event(
            "response.output_text.delta", item_id=self.message_id, output_index=0,
            content_index=0, delta=delta, logprobs=[])]

    def _open(self) -> list[dict[str, Any]]:
        if self._opened:
            return []
        self._opened = True
        return [self._event("response.output_item.added", output_index=0,
                            item={**self._message(""), "status": "in_progress",
                                  "content": []}),
                self._event("response.content_part.added", item_id=self.message_id,
                            output_index=0, content_index=0, part=self._part(""))]

    def _end(self, done: Done) -> list[dict[str, Any]]:
        if self.done:
            return []
        self.done = True
        text = done.choices[0].text if done.choices else done.text
        self.text = text
        calls = parse_tool_calls(text) if self.tool_calls else None
        if calls is not None:
            self._content, self._calls = calls
        events: list[dict[str, Any]] = []
        content = self._content if calls is not None else text
        if content or calls is None:
            events += self._send(content or "")
            events += self._open()
            events += [
                self._event("response.output_text.done", item_id=self.message_id,
                            output_index=0, content_index=0, text=content or "", logprobs=[]),
                self._event("response.content_part.done", item_id=self.message_id,
                            output_index=0, content_index=0, part=self._part(content or "")),
                self._event("response.output_item.done", output_index=0,
                            item=self._message(content or ""))]
        first = 1 if events else 0
        for i, item in enumerate(self._call_items()):
            events += [
                self._event("response.output_item.added", output_index=first + i,
                            item={**item, "status": "in_progress"}),
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=first + i, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=first + i, item=item)]
        self.final = self._object(*self._outcome(done))
        events.append(self._event("response.completed" if self.final["status"] == "completed"
                                  else "response.incomplete", response=self.final))
        return events

    # -- the objects ------------------------------------------------------------------------------

    def _outcome(self, done: Done) -> tuple[str, list[dict[str, Any]], Usage]:
        output = self._call_items()
        if not self._calls or self._content:
            output.insert(0, self._message(self._content if self._calls else self.text))
        reason = done.choices[0].finish_reason if done.choices else done.finish_reason
        status = "incomplete" if reason == "length" and not self._calls else "completed"
        return status, output, done.usage

    def _object(self, status: str, output: list[dict[str, Any]],
                usage: Usage | None) -> dict[str, Any]:
        text = "".join(part["text"] for item in output if item["type"] == "message"
                       for part in item["content"])
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "output_text": text,
            "error": self.failed, "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}},
            **self.echo}

    def _message(self, text: str | None) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": "completed",
                "role": "assistant", "content": [self._part(text or "")]}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _call_items(self) -> list[dict[str, Any]]:
        items = []
        for i, (name, arguments) in enumerate(self._calls):
            call_id = tool_call_id(self.response_id, 0, i)
            items.append({"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
                          "call_id": call_id, "name": name, "arguments": arguments,
                          "status": "completed"})
        return items

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}
