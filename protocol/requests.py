"""Requests on llmq:q:{<queue>}: the wire's request object and decoding a stream entry into one.

`decode_request_entry` turns any entry, however malformed, into a `DecodedRequest` or a
`RejectedEntry` and never raises: the payload size is checked before anything is parsed, and
msgspec's message names the offending field (``... - at `$.top_p```). The producer validates with
the same decoder (`parse_request`) before it sends, so what passes there passes here.

References: vLLM's `SamplingParams` and OpenAI's completions API for field names and bounds.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from llmq.protocol.encoding import (
    ENCODINGS,
    Encoding,
    as_str,
    encoders,
    field_items,
    json_encoder,
    msgpack_encoder,
)
from llmq.protocol.errors import ErrorCode, InvalidRequest
from llmq.protocol.names import NAME_PATTERN, is_valid_name
from llmq.protocol.response_format import (
    Guided,
    ResponseFormat,
    constrains,
    output_constraint,
)
from llmq.protocol.tools import MAX_TOOLS, Tool, ToolCall

logger = logging.getLogger(__name__)

# --- Wire caps. Checked before the scheduler sees anything; docs/protocol.md lists them. ---------
MAX_PAYLOAD_BYTES = 1 << 20  # one entry's payload, checked before it is parsed
# NOTE: an oversized payload is still read for its id (a skipping decode, a few ms per MB), so its
# error reaches the stream its producer follows; past this (deploy/redis.conf's
# proto-max-bulk-len lets no larger argument in) not even that.
MAX_PROBED_PAYLOAD_BYTES = 16 << 20
MAX_PROMPT_CHARS = 262_144  # a prompt, and each message's content
MAX_MESSAGES = 256
MAX_PROMPT_TOKEN_IDS = 65_536
MAX_TOKENS_LIMIT = 32_768  # max_tokens and min_tokens; the worker also checks the context length
DEFAULT_MAX_TOKENS = 256
# NOTE: the next four equal worker/engine/sampling_params.py's limits (a unit test keeps them
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
MAX_LOGIT_BIAS = 1_024  # entries of `logit_bias` (OpenAI allows 300)
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias|, OpenAI's bound
MAX_ALLOWED_TOKEN_IDS = 65_536
MAX_BAD_WORDS = 128
TASKS = ("generate", "embed", "tokenize", "detokenize")

# NOTE: `\Z`, not `$`: Python's `$` also matches before a trailing newline.
RequestId = Annotated[str, Meta(pattern=f"^{NAME_PATTERN}\\Z")]
# NOTE: an explicit id may not have the form of a stream entry id (`<ms>-<seq>`): that name
# belongs to the id-less request added as that entry, whose producer follows llmq:r:<entry id>,
# and no other entry may write there.
ENTRY_ID_RE = re.compile(r"[0-9]+-[0-9]+")


def is_usable_request_id(value: object) -> bool:
    """Whether a payload's `id` may name a result stream: a valid name, not an entry id."""
    return is_valid_name(value) and ENTRY_ID_RE.fullmatch(value) is None

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_LEN)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# version-trace_id-parent_id-flags in lowercase hex, the form of W3C trace context version 00
Traceparent = Annotated[str, Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z")]
LogitBias = Annotated[float, Meta(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
BadWord = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_LEN)]
# What the worker does with the prompt: generate from it (the default), or answer from the prompt
# alone (worker/engine/prompt_tasks.py): its embedding, its token ids, or (token ids given) text.
Task = Literal["generate", "embed", "tokenize", "detokenize"]


class Message(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One chat message; the worker renders `messages` with the model's chat template.

    `content` may be null only on an assistant turn that called tools (`tool_calls`); a `tool`
    turn answers the call `tool_call_id` (llmq.protocol.tools)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None
    name: Annotated[str, Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs `content` (null only on an assistant "
                             "turn with `tool_calls`)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"`tool_calls` belong on assistant messages, not {self.role}")


class Request(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One generation request, exactly as on the wire (docs/protocol.md lists every field)."""

    id: RequestId | None = None  # None: the stream entry id is the request id
    prompt: Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    prompt_token_ids: Annotated[
        list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)] | None = None
    # None: DEFAULT_MAX_TOKENS, or fewer when the context leaves less room (as vLLM defaults);
    # a number given must fit the context with the prompt, or the request is prompt_too_long
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
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
    # chat: the functions the model may call, rendered by its chat template (protocol/tools.py)
    tools: Annotated[list[Tool], Meta(min_length=1, max_length=MAX_TOOLS)] | None = None
    # chat: extra variables for the chat template (e.g. Qwen3's `enable_thinking`)
    chat_template_kwargs: dict[str, Any] | None = None
    # chat: false renders no opening of the assistant's turn (the prompt ends with the last
    # message, e.g. for a base model's completion of a transcript)
    add_generation_prompt: bool = True
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    # True: special-token text in the prompt or message content is parsed as control tokens
    # (trusted callers only; by default it is encoded as the text it is).
    allow_special_tokens: bool = False
    # False: never speculate for this request on a worker running speculative decoding (the
    # tokens are the same either way; it only spends no compute on drafts).
    speculative: bool = True
    # The W3C trace context of the producer's span (https://www.w3.org/TR/trace-context/): a
    # worker that traces parents its spans of this request on it, so one trace follows the
    # request across processes. Any producer may set it; workers that do not trace ignore it.
    traceparent: Traceparent | None = None
    # vLLM's extras over the logits (worker/engine/logits_adjustments.py): a bias added to the
    # logits of these token ids; only these ids may be sampled; words that may not be generated.
    logit_bias: Annotated[dict[TokenId, LogitBias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[
        list[TokenId], Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[BadWord], Meta(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: the log-probability of each prompt token (and the top n there), on `done`
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # chat: the prompt ends inside the last message, which the model continues (vLLM's; needs
    # add_generation_prompt false)
    continue_final_message: bool = False
    # prompt: false adds no BOS (vLLM's `add_special_tokens`)
    add_special_tokens: bool = True
    task: Task = "generate"
    # The LoRA adapter to run under, by its name in the worker's adapter directory (None: the
    # base model). An unknown or unusable adapter is an invalid_request naming it.
    lora: Annotated[str, Meta(pattern=f"^{NAME_PATTERN}\\Z")] | None = None
    # The priority class: interactive work is read and scheduled before batch work, which
    # fills the capacity left (docs/protocol.md, section 3a). None: the lane of the stream the
    # entry is on (a plain XADD to llmq:q:{<queue>} is interactive).
    lane: Literal["interactive", "batch"] | None = None

    def __post_init__(self) -> None:
        # NOTE: msgspec turns a ValueError raised here into its ValidationError, so these checks
        # reach the caller exactly like the per-field bounds above.
        if self.id is not None and ENTRY_ID_RE.fullmatch(self.id):
            raise ValueError(f"`id` {self.id!r} has the form of a stream entry id, which names "
                             "the result stream of a request sent without an id: choose another")
        given = [name for name in ("prompt", "messages", "prompt_token_ids")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            got = " and ".join(f"`{n}`" for n in given) if given else "none"
            raise ValueError(
                f"exactly one of `prompt`, `messages`, `prompt_token_ids` is required, got {got}")
        if self.min_tokens > (max_tokens := self.max_tokens or DEFAULT_MAX_TOKENS):
            raise ValueError(f"`min_tokens` ({self.min_tokens}) must be <= `max_tokens` "
                             f"({max_tokens})")
        if self.guided is not None and constrains(self.response_format):
            raise ValueError("`response_format` and `guided` both constrain the output: give one")
        if self.messages is None and (self.tools or self.chat_template_kwargs
                                      or not self.add_generation_prompt):
            raise ValueError("`tools`, `chat_template_kwargs` and `add_generation_prompt` need "
                             "`messages`")
        if self.continue_final_message and (self.messages is None or self.add_generation_prompt):
            raise ValueError("`continue_final_message` needs `messages` and "
                             "`add_generation_prompt` false (the last message is continued, no "
                             "new turn is opened)")
        if not self.add_special_tokens and self.prompt is None:
            raise ValueError("`add_special_tokens` false applies to `prompt` only")
        if self.task != "generate":
            self._check_task()
        if self.metadata is not None:
            size = _metadata_size(self.metadata)
            if size > MAX_METADATA_BYTES:
                raise ValueError(f"`metadata` is {size} bytes encoded, at most "
                                 f"{MAX_METADATA_BYTES} allowed")

    def _check_task(self) -> None:
        """A request answered from its prompt alone takes no generation options."""
        if self.task == "detokenize" and self.prompt_token_ids is None:
            raise ValueError("`task` detokenize needs `prompt_token_ids`")
        if self.task == "tokenize" and self.prompt_token_ids is not None:
            raise ValueError("`task` tokenize needs `prompt` or `messages`")
        generating = [name for name in ("response_format", "guided", "logprobs",
                                        "prompt_logprobs", "logit_bias", "allowed_token_ids",
                                        "bad_words") if getattr(self, name) is not None]
        if self.n != 1:
            generating.append("n")
        if generating:
            raise ValueError(f"`task` {self.task} generates nothing: drop "
                             + ", ".join(f"`{name}`" for name in generating))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `llmq.worker.engine.sampling_params.SamplingParams`."""
        return {
            "max_tokens": self.max_tokens or DEFAULT_MAX_TOKENS,
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
            "speculative": self.speculative,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": tuple(sorted((self.logit_bias or {}).items())),
            "allowed_token_ids": None if self.allowed_token_ids is None
            else tuple(self.allowed_token_ids),
            "bad_words": tuple(self.bad_words or ()),
            "prompt_logprobs": self.prompt_logprobs,
            "task": self.task,
        }

    def structured_output(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint for the engine; None when the output is free."""
        return output_constraint(self.response_format, self.guided)


def _metadata_size(metadata: dict[str, Any]) -> int:
    try:
        return len(json_encoder.encode(metadata))
    except TypeError:  # msgpack-only values (bin, ext) have no JSON form: measure them as msgpack
        return len(msgpack_encoder.encode(metadata))


_request_decoders: dict[str, msgspec.json.Decoder[Request] | msgspec.msgpack.Decoder[Request]] = {
    "json": msgspec.json.Decoder(Request), "msgpack": msgspec.msgpack.Decoder(Request)}


class _IdProbe(Struct):
    """Reads only `id` from a payload that failed validation, to know where to report it."""

    id: Any = None


_id_probes: dict[str, msgspec.json.Decoder[_IdProbe] | msgspec.msgpack.Decoder[_IdProbe]] = {
    "json": msgspec.json.Decoder(_IdProbe), "msgpack": msgspec.msgpack.Decoder(_IdProbe)}


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
    code: ErrorCode  # invalid_request or lost_payload
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
    return probe.id if is_usable_request_id(probe.id) else None


def decode_request_entry(
    raw_entry_id: bytes | str, fields: Mapping[Any, Any] | None
) -> DecodedRequest | RejectedEntry:
    """Decode one request stream entry. Never raises: a bad entry becomes a RejectedEntry.

    `fields` may be None or empty: XAUTOCLAIM/XCLAIM give that for entries deleted or trimmed
    while pending, reported as `lost_payload`.
    """
    entry_id = as_str(raw_entry_id)
    if not fields:
        return RejectedEntry(entry_id=entry_id, request_id=None, encoding=None,
                             code=ErrorCode.LOST_PAYLOAD,
                             message="the request entry's payload is gone (trimmed or deleted)")
    items = field_items(fields)
    if len(items) != 1 or items[0][0] not in ENCODINGS:
        names = ", ".join(sorted(repr(name[:40]) for name, _ in items[:8]))
        return RejectedEntry(entry_id=entry_id, request_id=None, encoding=None,
                             code=ErrorCode.INVALID_REQUEST,
                             message="a request entry has exactly one field, `json` or `msgpack`; "
                                     f"got {names}")
    encoding, payload = items[0]
    encoding_: Encoding = "json" if encoding == "json" else "msgpack"
    try:
        request = parse_request(payload, encoding_)
    except InvalidRequest as exc:
        request_id = (None if len(payload) > MAX_PROBED_PAYLOAD_BYTES
                      else _probe_request_id(payload, encoding_, entry_id))
        return RejectedEntry(entry_id=entry_id, request_id=request_id, encoding=encoding_,
                             code=ErrorCode.INVALID_REQUEST, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - the promise is "never raises"; keep the worker alive
        logger.warning("unexpected error decoding entry %s", entry_id, exc_info=True)
        return RejectedEntry(entry_id=entry_id, request_id=None, encoding=encoding_,
                             code=ErrorCode.INVALID_REQUEST,
                             message=f"could not decode payload: {type(exc).__name__}: {exc}")
    return DecodedRequest(entry_id=entry_id, request_id=request.id or entry_id,
                          encoding=encoding_, request=request)


def encode_request(request: Request, encoding: Encoding = "json") -> dict[str, bytes]:
    """The fields of a request entry; InvalidRequest when it is over the payload cap."""
    payload = encoders[encoding].encode(request)
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRequest(
            f"payload is {len(payload)} bytes, at most {MAX_PAYLOAD_BYTES} allowed")
    return {encoding: payload}


def entry_time_ms(entry_id: bytes | str) -> int:
    """The server time (unix ms) a stream entry was added, from its id `<ms>-<seq>`."""
    return parse_entry_id(entry_id)[0]


def parse_entry_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id `<ms>-<seq>` as (ms, seq), which orders like the stream does."""
    ms, _, seq = as_str(entry_id).partition("-")
    return int(ms), int(seq or 0)

