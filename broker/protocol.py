"""The wire protocol: what a request entry and a result event look like, as msgspec Structs.

This module is the one place bytes from Redis become typed objects (and back), through long-lived
typed decoders; docs/protocol.md is its user-facing copy. It imports only stdlib and msgspec, so
the engine's scheduler may import it without pulling in redis.

A request is a stream entry with exactly one field, `json` (a UTF-8 JSON object) or `msgpack`
(the same object as MessagePack). `decode_request_entry` turns any entry, however malformed, into
a `DecodedRequest` or a `RejectedEntry` and never raises: the payload size is checked before
anything is parsed, and msgspec's message names the offending field (``... - at `$.top_p```).
Events are written in the encoding their request used.

References: vLLM's `SamplingParams` and OpenAI's completions API for field names and bounds;
vLLM v1 `engine/__init__.py` for msgspec wire structs.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from llmq.broker.errors import InvalidRequest, ProtocolError
from llmq.broker.keys import NAME_PATTERN, is_valid_name

__all__ = [
    "DEAD_LETTER_FIELD",
    "DEFAULT_MAX_TOKENS",
    "ENCODINGS",
    "MAX_DEADLINE_MS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_MESSAGES",
    "MAX_METADATA_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_PRIORITY",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKEN_IDS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LEN",
    "MAX_TOKENS_LIMIT",
    "CancelNotice",
    "DeadLetter",
    "DecodedRequest",
    "Delta",
    "Done",
    "Encoding",
    "Choice",
    "Error",
    "ErrorCode",
    "Guided",
    "JsonSchema",
    "Event",
    "Message",
    "RejectedEntry",
    "Request",
    "ResponseFormat",
    "ResponseFormatJsonObject",
    "ResponseFormatJsonSchema",
    "ResponseFormatText",
    "Start",
    "Timings",
    "TokenLogprob",
    "Usage",
    "WorkerHeartbeat",
    "decode_cancel",
    "decode_dead_letter",
    "decode_event",
    "decode_heartbeat",
    "decode_request_entry",
    "encode_cancel",
    "encode_dead_letter",
    "encode_event",
    "encode_heartbeat",
    "encode_request",
    "entry_time_ms",
    "is_terminal",
    "parse_request",
]

logger = logging.getLogger(__name__)

# --- Wire caps. Checked before the scheduler sees anything; docs/protocol.md lists them. ---------
MAX_PAYLOAD_BYTES = 1 << 20  # one entry's payload, checked before it is parsed
MAX_PROMPT_CHARS = 262_144  # a prompt, and each message's content
MAX_MESSAGES = 256
MAX_PROMPT_TOKEN_IDS = 65_536
MAX_TOKENS_LIMIT = 32_768  # max_tokens and min_tokens; the worker also checks the context length
DEFAULT_MAX_TOKENS = 256
# NOTE: the next three equal worker/engine/sampling_params.py's limits (a unit test keeps them
# equal): anything the wire accepts must also build a SamplingParams, or the engine would see it.
MAX_STOP_STRINGS = 64  # stop strings, and separately stop_token_ids
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_N = 64  # completions of one prompt (`n`)
MAX_METADATA_BYTES = 16_384  # metadata is echoed on the terminal event, so it is kept small
MAX_MODEL_NAME_LEN = 256
MAX_PRIORITY = 1_000_000
MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
MAX_TOKEN_ID = 2**31 - 1  # a sanity bound only: the worker checks ids against its vocabulary

Encoding = Literal["json", "msgpack"]
ENCODINGS: tuple[Encoding, ...] = ("json", "msgpack")
DEAD_LETTER_FIELD = "dead_letter"


class ErrorCode(enum.StrEnum):
    """Stable `code` values of `error` events; readers must accept codes not listed here."""

    INVALID_REQUEST = "invalid_request"  # failed decoding or validation (message names the field)
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) does not fit the model context
    INVALID_TOKEN_ID = "invalid_token_id"  # a token id outside the model's vocabulary
    DEADLINE_EXCEEDED = "deadline_exceeded"  # not started within deadline_ms of being queued
    POISON = "poison"  # delivered max_deliveries times without finishing: dead-lettered
    CANCELLED = "cancelled"  # reserved: llmq reports cancellation as done{finish_reason=cancelled}
    PREEMPTED = "preempted"  # preempted more often than the engine allows
    NUMERICAL = "numerical"  # NaN/inf logits for this request
    ENGINE_ERROR = "engine_error"  # the engine failed this request for another reason
    LOST_PAYLOAD = "lost_payload"  # the entry was trimmed or deleted before a worker read it


# NOTE: `\Z`, not `$`: Python's `$` also matches before a trailing newline.
RequestId = Annotated[str, Meta(pattern=f"^{NAME_PATTERN}\\Z")]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_LEN)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class Message(Struct, forbid_unknown_fields=True):
    """One chat message; the worker renders `messages` with the model's chat template."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]


class JsonSchema(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """OpenAI's `response_format.json_schema`: the output is JSON valid under `schema`."""

    name: Annotated[str, Meta(max_length=256)] = "response"
    schema: dict[str, Any] | bool
    description: str | None = None
    strict: bool | None = None  # accepted for OpenAI clients; llmq always enforces the schema


class ResponseFormatText(Struct, tag="text", forbid_unknown_fields=True):
    """No constraint: OpenAI's default."""


class ResponseFormatJsonObject(Struct, tag="json_object", forbid_unknown_fields=True):
    """Any JSON object."""


class ResponseFormatJsonSchema(Struct, tag="json_schema", forbid_unknown_fields=True):
    json_schema: JsonSchema


# OpenAI's shapes: {"type": "text"}, {"type": "json_object"},
# {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}.
ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class Guided(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """vLLM-style guided decoding beyond JSON: exactly one of the three."""

    regex: Annotated[str, Meta(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    grammar: Annotated[str, Meta(min_length=1)] | None = None  # Lark, or GBNF (llama.cpp)

    def __post_init__(self) -> None:
        given = [n for n in ("regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"`guided` takes exactly one of `regex`, `choice`, `grammar`, "
                             f"got {' and '.join(given) if given else 'none'}")


class Request(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One generation request, exactly as on the wire (docs/protocol.md lists every field)."""

    id: RequestId | None = None  # None: the stream entry id is the request id
    prompt: Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    prompt_token_ids: Annotated[
        list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] = DEFAULT_MAX_TOKENS
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # 0 means greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0  # 1 disables
    top_k: Annotated[int, Meta(ge=-1, le=1_000_000)] = 0  # 0 or -1 (vLLM's spelling) disable
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0  # 0 disables
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0  # 1 disables
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # 0: sampled token only
    priority: Annotated[int, Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0  # lower runs first
    deadline_ms: Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    stream: bool = True  # False: no delta events, only start and the terminal event
    metadata: dict[str, Any] | None = None  # echoed back on the terminal event
    model: Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_NAME_LEN)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # completions, sampled over one prefill
    response_format: ResponseFormat | None = None  # OpenAI's shapes
    guided: Guided | None = None  # regex, choice or grammar

    def __post_init__(self) -> None:
        # NOTE: msgspec turns a ValueError raised here into its ValidationError, so these checks
        # reach the caller exactly like the per-field bounds above.
        given = [name for name in ("prompt", "messages", "prompt_token_ids")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            got = " and ".join(f"`{n}`" for n in given) if given else "none"
            raise ValueError(
                f"exactly one of `prompt`, `messages`, `prompt_token_ids` is required, got {got}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"`min_tokens` ({self.min_tokens}) must be <= `max_tokens` "
                             f"({self.max_tokens})")
        if self.guided is not None and not isinstance(self.response_format,
                                                      ResponseFormatText | None):
            raise ValueError("`response_format` and `guided` both constrain the output: give one")
        if self.metadata is not None:
            size = _metadata_size(self.metadata)
            if size > MAX_METADATA_BYTES:
                raise ValueError(f"`metadata` is {size} bytes encoded, at most "
                                 f"{MAX_METADATA_BYTES} allowed")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `llmq.worker.engine.sampling_params.SamplingParams`."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop_strings,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logprobs": self.logprobs,
            "n": self.n,
        }

    def structured_output(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint, as the engine's StructuredOutputParams takes
        them (the schema and the choices as JSON text); None when the output is free."""
        fmt, guided = self.response_format, self.guided
        if isinstance(fmt, ResponseFormatJsonObject):
            return "json_object", ""
        if isinstance(fmt, ResponseFormatJsonSchema):
            return "json_schema", _json_encoder.encode(fmt.json_schema.schema).decode()
        if guided is None:
            return None
        if guided.regex is not None:
            return "regex", guided.regex
        if guided.choice is not None:
            return "choice", _json_encoder.encode(guided.choice).decode()
        assert guided.grammar is not None
        return "grammar", guided.grammar


def _metadata_size(metadata: dict[str, Any]) -> int:
    try:
        return len(_json_encoder.encode(metadata))
    except TypeError:  # msgpack-only values (bin, ext) have no JSON form: measure them as msgpack
        return len(_msgpack_encoder.encode(metadata))


# --- Events on llmq:r:<request_id> ---------------------------------------------------------------
# NOTE: events do not forbid unknown fields, so readers keep working when workers add fields.


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache


class Timings(Struct):
    """Seconds, from the request's stream entry time (the server's clock at XADD)."""

    queue: float  # until the engine first scheduled it
    ttft: float | None  # until the first output token; None when none was produced
    e2e: float  # until the terminal event
    per_token: float | None  # mean gap between output tokens after the first; None below 2 tokens


class TokenLogprob(Struct):
    """One sampled token's log-probability. None stands for -inf/NaN, which JSON cannot carry."""

    token_id: int
    logprob: float | None
    top_token_ids: list[int] = []
    top_logprobs: list[float | None] = []


class _EventBase(Struct, tag_field="type"):
    request_id: str
    attempt: Annotated[int, Meta(ge=1)]  # the delivery that produced it; a higher one supersedes


class Start(_EventBase, tag="start"):
    """A worker began the attempt: readers drop any text of earlier attempts."""

    worker: str
    prompt_tokens: int
    model: str = ""


class Delta(_EventBase, tag="delta"):
    """New output of the attempt; `seq` counts 0, 1, 2... so a reader can detect a gap."""

    seq: Annotated[int, Meta(ge=0)]
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of the request's `n` completions the text belongs to


class Choice(Struct):
    """One of the `n` completions, on a `done` event of a request with n > 1."""

    index: int
    text: str
    finish_reason: Literal["stop", "length", "cancelled"]
    completion_tokens: int
    stop_reason: int | str | None = None


class Done(_EventBase, tag="done"):
    """The attempt finished; `text` is the whole output (the deltas concatenated)."""

    finish_reason: Literal["stop", "length", "cancelled"]
    text: str
    usage: Usage
    timings: Timings
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    metadata: dict[str, Any] | None = None
    # n > 1: every completion, by index; `text`, `finish_reason`, `stop_reason` are choice 0's
    # and `usage` counts the prompt once and the completions' tokens together.
    choices: list[Choice] | None = None


class Error(_EventBase, tag="error"):
    """The attempt failed; `code` is an `ErrorCode` value, `message` names the field at fault."""

    code: str
    message: str
    details: dict[str, Any] | None = None  # machine-readable specifics, e.g. {"limit": 2048}
    metadata: dict[str, Any] | None = None


Event = Start | Delta | Done | Error


def is_terminal(event: Event) -> bool:
    return isinstance(event, Done | Error)


# --- Long-lived codecs ---------------------------------------------------------------------------
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_encoders: dict[str, msgspec.json.Encoder | msgspec.msgpack.Encoder] = {
    "json": _json_encoder, "msgpack": _msgpack_encoder}
_request_decoders: dict[str, msgspec.json.Decoder[Request] | msgspec.msgpack.Decoder[Request]] = {
    "json": msgspec.json.Decoder(Request), "msgpack": msgspec.msgpack.Decoder(Request)}
_event_decoders: dict[str, msgspec.json.Decoder[Event] | msgspec.msgpack.Decoder[Event]] = {
    "json": msgspec.json.Decoder(Event), "msgpack": msgspec.msgpack.Decoder(Event)}


class _IdProbe(Struct):
    """Reads only `id` from a payload that failed validation, to know where to report it."""

    id: Any = None


_id_probes: dict[str, msgspec.json.Decoder[_IdProbe] | msgspec.msgpack.Decoder[_IdProbe]] = {
    "json": msgspec.json.Decoder(_IdProbe), "msgpack": msgspec.msgpack.Decoder(_IdProbe)}


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _field_items(fields: Mapping[Any, Any]) -> list[tuple[str, bytes]]:
    return [(_text(k), v.encode() if isinstance(v, str) else v) for k, v in fields.items()]


# --- Requests ------------------------------------------------------------------------------------


class DecodedRequest(Struct, frozen=True, kw_only=True):
    """A request entry that passed every wire check (the worker still checks the model's limits)."""

    entry_id: str
    request_id: str  # `request.id`, or the entry id when the payload has none
    encoding: Encoding  # write this request's events in this encoding
    request: Request


class RejectedEntry(Struct, frozen=True, kw_only=True):
    """A request entry that cannot run; the worker reports it and acks it."""

    entry_id: str
    request_id: str | None  # None: unknown or unusable as a key, so the entry is dead-lettered
    encoding: Encoding | None
    code: str  # ErrorCode value: invalid_request or lost_payload
    message: str


def parse_request(payload: bytes, encoding: Encoding) -> Request:
    """Decode and validate one payload; InvalidRequest (message names the field) when it fails."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRequest(
            f"payload is {len(payload)} bytes, at most {MAX_PAYLOAD_BYTES} allowed")
    try:
        return _request_decoders[encoding].decode(payload)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{encoding} payload is malformed: {exc}") from None
    except RecursionError:
        # NOTE: msgspec bounds its recursion with Python's limit and raises instead of crashing.
        raise InvalidRequest(f"{encoding} payload nests too deeply") from None


def _probe_request_id(payload: bytes, encoding: Encoding, entry_id: str) -> str | None:
    try:
        probe = _id_probes[encoding].decode(payload)
    except (msgspec.MsgspecError, RecursionError, ValueError):
        return None
    if probe.id is None:
        return entry_id  # no id given: the entry id is the request id
    return probe.id if is_valid_name(probe.id) else None


def decode_request_entry(
    entry_id: bytes | str, fields: Mapping[Any, Any] | None
) -> DecodedRequest | RejectedEntry:
    """Decode one request stream entry. Never raises: a bad entry becomes a RejectedEntry.

    `fields` may be None or empty: XAUTOCLAIM/XCLAIM give that for entries deleted or trimmed
    while pending, reported as `lost_payload`.
    """
    entry_id = _text(entry_id)
    if not fields:
        return RejectedEntry(entry_id=entry_id, request_id=None, encoding=None,
                             code=ErrorCode.LOST_PAYLOAD.value,
                             message="the request entry's payload is gone (trimmed or deleted)")
    items = _field_items(fields)
    if len(items) != 1 or items[0][0] not in ENCODINGS:
        names = ", ".join(sorted(repr(name[:40]) for name, _ in items[:8]))
        return RejectedEntry(entry_id=entry_id, request_id=None, encoding=None,
                             code=ErrorCode.INVALID_REQUEST.value,
                             message="a request entry has exactly one field, `json` or `msgpack`; "
                                     f"got {names}")
    encoding, payload = items[0]
    encoding_: Encoding = "json" if encoding == "json" else "msgpack"
    try:
        request = parse_request(payload, encoding_)
    except InvalidRequest as exc:
        # NOTE: an oversized payload is not parsed at all, not even for its id.
        request_id = (None if len(payload) > MAX_PAYLOAD_BYTES
                      else _probe_request_id(payload, encoding_, entry_id))
        return RejectedEntry(entry_id=entry_id, request_id=request_id, encoding=encoding_,
                             code=ErrorCode.INVALID_REQUEST.value, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - the promise is "never raises"; keep the worker alive
        logger.warning("unexpected error decoding entry %s", entry_id, exc_info=True)
        return RejectedEntry(entry_id=entry_id, request_id=None, encoding=encoding_,
                             code=ErrorCode.INVALID_REQUEST.value,
                             message=f"could not decode payload: {type(exc).__name__}: {exc}")
    return DecodedRequest(entry_id=entry_id, request_id=request.id or entry_id,
                          encoding=encoding_, request=request)


def encode_request(request: Request, encoding: Encoding = "json") -> dict[str, bytes]:
    """The fields of a request entry; InvalidRequest when it is over the payload cap."""
    payload = _encoders[encoding].encode(request)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRequest(
            f"payload is {len(payload)} bytes, at most {MAX_PAYLOAD_BYTES} allowed")
    return {encoding: payload}


def entry_time_ms(entry_id: bytes | str) -> int:
    """The server time (unix ms) a stream entry was added, from its id `<ms>-<seq>`."""
    return int(_text(entry_id).partition("-")[0])


# --- Events --------------------------------------------------------------------------------------


def encode_event(event: Event, encoding: Encoding = "json") -> dict[str, bytes]:
    """The fields of a result stream entry, in the encoding of the event's request."""
    return {encoding: _encoders[encoding].encode(event)}


def decode_event(fields: Mapping[Any, Any]) -> Event:
    """One result stream entry as an event; ProtocolError when it is not one."""
    items = _field_items(fields) if fields else []
    if len(items) != 1 or items[0][0] not in ENCODINGS:
        raise ProtocolError(f"an event entry has one field, `json` or `msgpack`; got "
                            f"{[name[:40] for name, _ in items[:8]]}")
    encoding, payload = items[0]
    try:
        return _event_decoders[encoding].decode(payload)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise ProtocolError(f"undecodable {encoding} event: {exc}") from None


# --- Cancellations on llmq:cancel:<queue> -------------------------------------------------------


class CancelNotice(Struct):
    request_id: RequestId


_cancel_decoder = msgspec.json.Decoder(CancelNotice)


def encode_cancel(request_id: str) -> dict[str, bytes]:
    return {"json": _json_encoder.encode(CancelNotice(request_id))}


def decode_cancel(fields: Mapping[Any, Any]) -> str | None:
    """The request id of a cancel stream entry; None (logged) when the entry is not one."""
    items = _field_items(fields) if fields else []
    try:
        if len(items) == 1 and items[0][0] == "json":
            return _cancel_decoder.decode(items[0][1]).request_id
    except (msgspec.MsgspecError, RecursionError) as exc:
        logger.warning("ignoring undecodable cancel entry: %s", exc)
        return None
    logger.warning("ignoring cancel entry without a single `json` field")
    return None


# --- Dead letters on llmq:dlq:<queue> -----------------------------------------------------------


class DeadLetter(Struct, kw_only=True):
    """Why an entry was dead-lettered; stored as JSON in the entry's `dead_letter` field."""

    queue: str
    entry_id: str  # the entry's id on the request stream
    request_id: str | None
    code: str  # ErrorCode value
    message: str
    deliveries: int = 0  # the entry's delivery count when it was dead-lettered
    worker: str = ""
    at_ms: int = 0  # unix ms


_dead_letter_decoder = msgspec.json.Decoder(DeadLetter)


def encode_dead_letter(
    dead_letter: DeadLetter, payload_fields: Mapping[Any, Any] | None
) -> dict[str, bytes]:
    """A DLQ entry: the original payload fields (so it can be retried as is) plus `dead_letter`.

    A payload over MAX_PAYLOAD_BYTES is not copied: a dead letter must not double a huge entry.
    """
    fields: dict[str, bytes] = {}
    items = _field_items(payload_fields) if payload_fields else []
    if sum(len(v) for _, v in items) <= MAX_PAYLOAD_BYTES:
        fields.update((k, v) for k, v in items if k != DEAD_LETTER_FIELD)
    fields[DEAD_LETTER_FIELD] = _json_encoder.encode(dead_letter)
    return fields


def decode_dead_letter(fields: Mapping[Any, Any]) -> tuple[DeadLetter, dict[str, bytes]]:
    """(why, original payload fields) of a DLQ entry; ProtocolError when it is not one."""
    items = dict(_field_items(fields) if fields else [])
    raw = items.pop(DEAD_LETTER_FIELD, None)
    if raw is None:
        raise ProtocolError("a dead-letter entry needs a `dead_letter` field")
    try:
        return _dead_letter_decoder.decode(raw), items
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise ProtocolError(f"undecodable dead letter: {exc}") from None


# --- Worker heartbeats on llmq:w:<worker_id> ----------------------------------------------------


class WorkerHeartbeat(Struct, kw_only=True):
    """A worker's state, written as a flat hash so `redis-cli HGETALL` stays readable."""

    worker_id: str
    queue: str
    model: str = ""
    pid: int = 0
    host: str = ""
    started_ms: int = 0  # unix ms
    heartbeat_ms: int = 0  # unix ms of this heartbeat
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV-cache blocks in use, 0..1
    tokens_per_s: float = 0.0  # output tokens per second, recent average
    version: str = ""
    sleeping: int = 0  # 0 awake; 1 KV cache freed; 2 weights freed too (`llmq admin sleep`)


def encode_heartbeat(heartbeat: WorkerHeartbeat) -> dict[str, str]:
    return {k: str(v) for k, v in msgspec.structs.asdict(heartbeat).items()}


def decode_heartbeat(fields: Mapping[Any, Any]) -> WorkerHeartbeat:
    """A heartbeat hash (string values) as a struct; ProtocolError when it is not one."""
    try:
        # NOTE: strict=False is what parses the hash's strings into ints and floats.
        return msgspec.convert({_text(k): _text(v) for k, v in fields.items()},
                               WorkerHeartbeat, strict=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"undecodable heartbeat: {exc}") from None
