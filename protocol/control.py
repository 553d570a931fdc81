"""Utility calls on llmq:ctl:{<queue>} and their answers on llmq:ctlr:<call_id>.

After vLLM v1's `EngineCore` utility calls (`call_utility`: reset_prefix_cache, sleep, wake_up,
profile), carried over Redis: an admin adds one `ControlCall` to the control stream, which every
worker of the queue follows; each worker that takes the call answers with one `ControlReply`.
Both are JSON in one `json` field, as requests are. Sending a call and gathering the answers is
llmq.broker.control's; running one is the worker's (worker/utility_calls.py).

Methods and their `args`:

    reset_prefix_cache                 forget every cached prefix block (refused while requests
                                       run: their blocks are in use)
    sleep        {"level": 1 | 2}      stop reading, hand in-flight work back to peers, free the
                                       KV cache (level 2: the weights too)
    wake_up                            reallocate what sleep freed, read again
    profile      {"action": "start" | "stop", "dir": optional}
                                       torch profiler; stop writes a Chrome trace and answers
                                       its path
    stats                              the engine's counters
    load_lora    {"name": adapter}     load a LoRA adapter from the worker's --lora-dir now (into
                                       its LRU), so the first request for it pays nothing;
                                       an error answer names what is wrong with it
    unload_lora  {"name": adapter}     drop it from the LRU (running requests keep it until they
                                       finish); answers whether it was loaded
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
from msgspec import Struct

from llmq.protocol.encoding import field_items, json_encoder
from llmq.protocol.requests import RequestId

__all__ = ["METHODS", "ControlCall", "ControlReply", "decode_call", "decode_reply",
           "encode_call", "encode_reply"]

T = TypeVar("T")

METHODS: tuple[str, ...] = ("reset_prefix_cache", "sleep", "wake_up", "profile", "stats",
                             "load_lora", "unload_lora")


class ControlCall(Struct, kw_only=True):
    """One utility call. `method` is a string so a worker can answer an unknown one with an
    error rather than ignore it."""

    call_id: RequestId  # names the answer stream, so it obeys the key-name rule
    method: str
    args: dict[str, Any] = {}
    worker: str | None = None  # only this worker answers; None: every worker of the queue


class ControlReply(Struct, kw_only=True):
    call_id: str
    worker: str
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None


_call_decoder = msgspec.json.Decoder(ControlCall)
_reply_decoder = msgspec.json.Decoder(ControlReply)


def encode_call(call: ControlCall) -> dict[str, bytes]:
    return {"json": json_encoder.encode(call)}


def encode_reply(reply: ControlReply) -> dict[str, bytes]:
    return {"json": json_encoder.encode(reply)}


def decode_call(fields: Mapping[Any, Any]) -> ControlCall | None:
    """The call in a control-stream entry; None when the entry is not one (logged by callers)."""
    return _decode(_call_decoder, fields)


def decode_reply(fields: Mapping[Any, Any]) -> ControlReply | None:
    return _decode(_reply_decoder, fields)


def _decode(decoder: msgspec.json.Decoder[T], fields: Mapping[Any, Any]) -> T | None:
    """The struct in an entry's one `json` field; None for any other entry."""
    items = field_items(fields) if fields else []
    if len(items) != 1 or items[0][0] != "json":
        return None
    try:
        return decoder.decode(items[0][1])
    except (msgspec.MsgspecError, RecursionError):
        return None
