"""The wire protocol: what llmq's stream entries look like, as msgspec Structs.

This package is the one place bytes from Redis become typed objects (and back), through
long-lived typed decoders; docs/protocol.md is its user-facing copy. It imports only stdlib and
msgspec (and llmq.broker's stdlib-only errors and key names), so the engine may import it
without pulling in redis. By concept:

    encoding.py   the two encodings of an entry (`json` / `msgpack` field), reading reply fields
    requests.py   the request object on llmq:q:{<queue>} and decoding an entry into one
    response_format.py  what a request may constrain its output to (`response_format`, `guided`)
    events.py     start / delta / done / error on llmq:r:{<request_id>}, and the terminal-event
                  builder the worker and `llmq generate -f` share
    records.py    operational records: cancellations, dead letters, worker heartbeats
    latency_histogram.py  TTFT counts in fixed buckets, carried by heartbeats
    control.py    utility calls on llmq:ctl:{<queue>} and the workers' answers

Everything public is re-exported here: `from llmq.protocol import Request, Done`.

References: vLLM v1 `engine/__init__.py` for msgspec wire structs.
"""

from llmq.protocol.control import (
    METHODS,
    ControlCall,
    ControlReply,
    decode_call,
    decode_reply,
    encode_call,
    encode_reply,
)
from llmq.protocol.encoding import ENCODINGS, Encoding, as_str
from llmq.protocol.errors import ErrorCode
from llmq.protocol.events import (
    Choice,
    Delta,
    Done,
    Error,
    Event,
    FinishedOutput,
    Start,
    Timings,
    TokenLogprob,
    Usage,
    decode_event,
    encode_event,
    gather_choices,
    is_terminal,
    terminal_event,
)
from llmq.protocol.latency_histogram import TTFT_BUCKETS_MS, LatencyHistogram
from llmq.protocol.records import (
    DEAD_LETTER_FIELD,
    CancelNotice,
    DeadLetter,
    WorkerHeartbeat,
    decode_cancel,
    decode_dead_letter,
    decode_heartbeat,
    encode_cancel,
    encode_dead_letter,
    encode_heartbeat,
)
from llmq.protocol.requests import (
    DEFAULT_MAX_TOKENS,
    MAX_DEADLINE_MS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_MODEL_NAME_LEN,
    MAX_N,
    MAX_PAYLOAD_BYTES,
    MAX_PRIORITY,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    DecodedRequest,
    Message,
    RejectedEntry,
    Request,
    decode_request_entry,
    encode_request,
    entry_time_ms,
    parse_entry_id,
    parse_request,
)
from llmq.protocol.response_format import (
    Guided,
    JsonSchema,
    ResponseFormat,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatText,
    output_constraint,
)

__all__ = [
    "DEAD_LETTER_FIELD",
    "DEFAULT_MAX_TOKENS",
    "ENCODINGS",
    "MAX_DEADLINE_MS",
    "MAX_LOGPROBS",
    "MAX_MESSAGES",
    "MAX_METADATA_BYTES",
    "MAX_MODEL_NAME_LEN",
    "MAX_N",
    "MAX_PAYLOAD_BYTES",
    "MAX_PRIORITY",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKEN_IDS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LEN",
    "MAX_TOKEN_ID",
    "MAX_TOKENS_LIMIT",
    "METHODS",
    "TTFT_BUCKETS_MS",
    "CancelNotice",
    "Choice",
    "ControlCall",
    "ControlReply",
    "DeadLetter",
    "DecodedRequest",
    "Delta",
    "Done",
    "Encoding",
    "Error",
    "ErrorCode",
    "Event",
    "FinishedOutput",
    "Guided",
    "JsonSchema",
    "LatencyHistogram",
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
    "as_str",
    "decode_call",
    "decode_cancel",
    "decode_dead_letter",
    "decode_event",
    "decode_heartbeat",
    "decode_reply",
    "decode_request_entry",
    "encode_call",
    "encode_cancel",
    "encode_dead_letter",
    "encode_event",
    "encode_heartbeat",
    "encode_reply",
    "encode_request",
    "entry_time_ms",
    "gather_choices",
    "is_terminal",
    "output_constraint",
    "parse_entry_id",
    "parse_request",
    "terminal_event",
]
