"""Operational records: cancellations, dead letters and worker heartbeats.

Not part of one request's life on the wire, but what operators and the workers themselves read:
`llmq:cancel:{<queue>}` (a stream every worker follows), `llmq:dlq:{<queue>}` (dead letters, with
the original payload kept for a retry) and `llmq:w:<worker_id>` (a flat heartbeat hash, readable
with `redis-cli HGETALL`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import Struct

from llmq.protocol.encoding import as_str, field_items, json_encoder
from llmq.protocol.errors import ProtocolError
from llmq.protocol.requests import MAX_PAYLOAD_BYTES, RequestId

logger = logging.getLogger(__name__)

DEAD_LETTER_FIELD = "dead_letter"

# --- Cancellations on llmq:cancel:{<queue>} -------------------------------------------------------


class CancelNotice(Struct):
    request_id: RequestId


_cancel_decoder = msgspec.json.Decoder(CancelNotice)


def encode_cancel(request_id: str) -> dict[str, bytes]:
    return {"json": json_encoder.encode(CancelNotice(request_id))}


def decode_cancel(fields: Mapping[Any, Any]) -> str | None:
    """The request id of a cancel stream entry; None (logged) when the entry is not one."""
    items = field_items(fields) if fields else []
    try:
        if len(items) == 1 and items[0][0] == "json":
            return _cancel_decoder.decode(items[0][1]).request_id
    except (msgspec.MsgspecError, RecursionError) as exc:
        logger.warning("ignoring undecodable cancel entry: %s", exc)
        return None
    logger.warning("ignoring cancel entry without a single `json` field")
    return None


# --- Dead letters on llmq:dlq:{<queue>} -----------------------------------------------------------


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
    items = field_items(payload_fields) if payload_fields else []
    if sum(len(v) for _, v in items) <= MAX_PAYLOAD_BYTES:
        fields.update((k, v) for k, v in items if k != DEAD_LETTER_FIELD)
    fields[DEAD_LETTER_FIELD] = json_encoder.encode(dead_letter)
    return fields


def decode_dead_letter(fields: Mapping[Any, Any]) -> tuple[DeadLetter, dict[str, bytes]]:
    """(why, original payload fields) of a DLQ entry; ProtocolError when it is not one."""
    items = dict(field_items(fields) if fields else [])
    raw = items.pop(DEAD_LETTER_FIELD, None)
    if raw is None:
        raise ProtocolError("a dead-letter entry needs a `dead_letter` field")
    try:
        return _dead_letter_decoder.decode(raw), items
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise ProtocolError(f"undecodable dead letter: {exc}") from None


# --- Worker heartbeats on llmq:w:<worker_id> ----------------------------------------------------


MAX_LISTED_LORAS = 256  # a heartbeat lists at most this many available adapters


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
    draining: int = 0  # 1 once it stopped reading to shut down (SIGTERM)
    prefix_cache_hit_rate: float = 0.0  # fraction of prompt tokens served from the cache
    # Cumulative since the worker started, for rates over any window (the gateway's charts):
    requests_total: int = 0  # terminal events written
    generated_tokens_total: int = 0
    ttft_hist: str = ""  # TTFT counts per bucket (LatencyHistogram.encode())
    # Speculative decoding: the method ("" when off), and the fraction of draft tokens accepted
    # since the worker started, 0..1.
    speculative_method: str = ""
    spec_acceptance_rate: float = 0.0
    # LoRA adapters, comma-separated names: those in memory, and those its --lora-dir holds
    # (at most MAX_LISTED_LORAS of them); both "" without one.
    loras_loaded: str = ""
    loras_available: str = ""
    # More cumulative figures, named after vLLM's metrics (the gateway's /metrics shows them as
    # llmq_* series; the *_hist fields are LatencyHistogram.encode(with_sum=True)):
    prompt_tokens_total: int = 0  # prompt tokens of finished requests
    cached_prompt_tokens_total: int = 0  # of those, served from the prefix cache
    preemptions_total: int = 0  # requests preempted for lack of KV blocks
    finished_stop_total: int = 0  # requests finished by reason (vLLM's request_success)
    finished_length_total: int = 0
    finished_cancelled_total: int = 0
    finished_error_total: int = 0
    queue_hist: str = ""  # arrival in the stream to first scheduled
    ttft_admitted_hist: str = ""  # first scheduled to first token (TTFT without queue time)
    itl_hist: str = ""  # mean gap between output tokens, one observation per request
    e2e_hist: str = ""  # arrival in the stream to the terminal event


def encode_heartbeat(heartbeat: WorkerHeartbeat) -> dict[str, str]:
    return {k: str(v) for k, v in msgspec.structs.asdict(heartbeat).items()}


def decode_heartbeat(fields: Mapping[Any, Any]) -> WorkerHeartbeat:
    """A heartbeat hash (string values) as a struct; ProtocolError when it is not one."""
    try:
        # NOTE: strict=False is what parses the hash's strings into ints and floats.
        return msgspec.convert({as_str(k): as_str(v) for k, v in fields.items()},
                               WorkerHeartbeat, strict=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"undecodable heartbeat: {exc}") from None

