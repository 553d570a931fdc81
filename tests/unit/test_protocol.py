"""The wire protocol: every bad entry becomes a rejection naming the field; events round-trip.

No Redis here: these are the bytes a stream entry can hold, fed to the decoder a worker uses.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmq import protocol
from llmq.broker.commands import build_submission
from llmq.protocol import (
    MAX_PAYLOAD_BYTES,
    CancelNotice,
    DeadLetter,
    DecodedRequest,
    Delta,
    Done,
    Error,
    RejectedEntry,
    Start,
    Timings,
    TokenLogprob,
    Usage,
    WorkerHeartbeat,
    decode_request_entry,
)
from llmq.protocol.errors import InvalidRequest, ProtocolError

ENTRY_ID = "1796013460689-0"


def _json(obj: Any) -> dict[bytes, bytes]:
    return {b"json": json.dumps(obj).encode()}


def _msgpack(obj: Any) -> dict[bytes, bytes]:
    return {b"msgpack": msgspec.msgpack.encode(obj)}


def _deep(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


# --- good entries --------------------------------------------------------------------------------


def test_the_redis_cli_example_from_the_design_decodes_with_documented_defaults() -> None:
    # Given the entry `XADD llmq:q:{default} '*' json '{"prompt":"Hi","max_tokens":8}'`
    fields = {b"json": b'{"prompt":"Hi","max_tokens":8}'}
    # When a worker decodes it
    decoded = decode_request_entry(ENTRY_ID.encode(), fields)
    # Then it is a request whose id is the entry id, answered in JSON, with the defaults
    assert isinstance(decoded, DecodedRequest)
    assert (decoded.request_id, decoded.entry_id, decoded.encoding) == (ENTRY_ID, ENTRY_ID, "json")
    request = decoded.request
    assert (request.prompt, request.max_tokens, request.temperature, request.top_p) == \
        ("Hi", 8, 1.0, 1.0)
    assert request.stream is True and request.metadata is None


def test_a_msgpack_chat_request_with_its_own_id_decodes() -> None:
    fields = _msgpack({"id": "chat-1", "messages": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}],
                       "stop": "\n", "top_k": -1, "metadata": {"row": 7}})
    decoded = decode_request_entry(ENTRY_ID, fields)
    assert isinstance(decoded, DecodedRequest)
    assert (decoded.request_id, decoded.encoding) == ("chat-1", "msgpack")
    assert decoded.request.messages[1] == protocol.Message("user", "Hi")
    # vLLM's top_k=-1 and a single stop string become what SamplingParams takes
    kwargs = decoded.request.sampling_kwargs()
    assert kwargs["top_k"] == 0 and kwargs["stop"] == ("\n",)


def test_string_fields_from_a_decode_responses_client_decode_too() -> None:
    decoded = decode_request_entry(ENTRY_ID, {"json": '{"prompt_token_ids":[1,2,3]}'})
    assert isinstance(decoded, DecodedRequest)
    assert decoded.request.prompt_token_ids == [1, 2, 3]


# --- bad entries: each gets its code, a message naming the field, and the id when known ---------

KNOWN = "known"  # the rejection still knows the request id (entry id, or the payload's id)

BAD_ENTRIES: list[tuple[str, Any, str, str | None]] = [
    # (case, fields, message fragment, request id: KNOWN or None -> dead letter)
    ("truncated json", {b"json": b'{"prompt": "hi"'}, "truncated", None),
    ("truncated msgpack", {b"msgpack": msgspec.msgpack.encode({"prompt": "hi"})[:-1]},
     "truncated", None),
    ("empty payload", {b"json": b""}, "malformed", None),
    ("garbage msgpack", {b"msgpack": b"\xc1"}, "malformed", None),
    ("invalid utf-8", {b"json": b'{"prompt": "\xff\xfe"}'}, "UTF-8", KNOWN),
    ("json NaN literal", {b"json": b'{"prompt":"x","temperature":NaN}'}, "malformed", None),
    ("non-object json", {b"json": b"[1, 2]"}, "Expected `object`, got `array`", None),
    ("non-object msgpack", _msgpack([1, 2]), "Expected `object`, got `array`", None),
    ("null top level", {b"json": b"null"}, "Expected `object`, got `null`", None),
    ("wrong field name", {b"data": b'{"prompt":"x"}'}, "exactly one field", None),
    ("two fields", {b"json": b'{"prompt":"x"}', b"msgpack": b"\x80"}, "exactly one field", None),
    ("unknown field", _json({"prompt": "x", "temprature": 0.5}), "unknown field `temprature`",
     KNOWN),
    ("unknown nested field", _json({"messages": [{"role": "user", "content": "x", "nam": "a"}]}),
     "unknown field `nam` - at `$.messages[0]`", KNOWN),
    ("wrong type", _json({"prompt": "x", "max_tokens": "8"}),
     "Expected `int | null`, got `str` - at `$.max_tokens`", KNOWN),
    ("float max_tokens", _json({"prompt": "x", "max_tokens": 8.5}), "at `$.max_tokens`", KNOWN),
    ("negative max_tokens", _json({"prompt": "x", "max_tokens": -1}),
     "Expected `int` >= 1 - at `$.max_tokens`", KNOWN),
    ("zero max_tokens", _msgpack({"prompt": "x", "max_tokens": 0}), ">= 1 - at `$.max_tokens`",
     KNOWN),
    ("huge max_tokens", _json({"prompt": "x", "max_tokens": 10**9}),
     "<= 32768 - at `$.max_tokens`", KNOWN),
    ("max_tokens past 64 bits", {b"json": b'{"prompt":"x","max_tokens":1' + b"0" * 30 + b"}"},
     "at `$.max_tokens`", KNOWN),
    ("NaN temperature", _msgpack({"prompt": "x", "temperature": math.nan}),
     "at `$.temperature`", KNOWN),
    ("infinite temperature", {b"json": b'{"prompt":"x","temperature":1e999}'},
     "at `$.temperature`", KNOWN),
    ("negative temperature", _json({"prompt": "x", "temperature": -1}),
     ">= 0.0 - at `$.temperature`", KNOWN),
    ("temperature above 2", _json({"prompt": "x", "temperature": 2.5}),
     "<= 2.0 - at `$.temperature`", KNOWN),
    ("top_p zero", _json({"prompt": "x", "top_p": 0}), "> 0.0 - at `$.top_p`", KNOWN),
    ("top_p above 1", _msgpack({"prompt": "x", "top_p": 1.5}), "<= 1.0 - at `$.top_p`", KNOWN),
    ("min_p above 1", _json({"prompt": "x", "min_p": 2}), "at `$.min_p`", KNOWN),
    ("penalty out of range", _json({"prompt": "x", "presence_penalty": 3}),
     "at `$.presence_penalty`", KNOWN),
    ("repetition penalty zero", _json({"prompt": "x", "repetition_penalty": 0}),
     "at `$.repetition_penalty`", KNOWN),
    ("negative seed", _json({"prompt": "x", "seed": -5}), "at `$.seed`", KNOWN),
    ("logprobs too many", _json({"prompt": "x", "logprobs": 21}), "<= 20 - at `$.logprobs`", KNOWN),
    ("too many stop strings", _json({"prompt": "x", "stop": ["s"] * 65}),
     "length <= 64 - at `$.stop`", KNOWN),
    ("empty stop string", _json({"prompt": "x", "stop": ""}), "at `$.stop`", KNOWN),
    ("stop string too long", _json({"prompt": "x", "stop": ["s" * 257]}), "at `$.stop[0]`",
     KNOWN),
    ("negative stop token id", _json({"prompt": "x", "stop_token_ids": [-1]}),
     "at `$.stop_token_ids[0]`", KNOWN),
    ("negative prompt token id", _msgpack({"prompt_token_ids": [1, -2]}),
     "at `$.prompt_token_ids[1]`", KNOWN),
    ("empty prompt", _json({"prompt": ""}), "at `$.prompt`", KNOWN),
    ("too many messages", _json({"messages": [{"role": "user", "content": "x"}] * 257}),
     "at `$.messages`", KNOWN),
    ("unknown role", _json({"messages": [{"role": "wizard", "content": "x"}]}),
     "at `$.messages[0].role`", KNOWN),
    ("prompt and messages", _json({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
     "exactly one of `prompt`, `messages`, `prompt_token_ids` is required, got `prompt` and "
     "`messages`", KNOWN),
    ("no prompt at all", _json({"max_tokens": 4}), "exactly one of", KNOWN),
    ("min_tokens above max_tokens", _json({"prompt": "x", "max_tokens": 4, "min_tokens": 5}),
     "`min_tokens` (5) must be <= `max_tokens` (4)", KNOWN),
    ("metadata too large", _json({"prompt": "x", "metadata": {"blob": "x" * 20_000}}),
     "`metadata` is 20011 bytes encoded, at most 16384 allowed", KNOWN),
    ("metadata not an object", _json({"prompt": "x", "metadata": [1]}), "at `$.metadata`", KNOWN),
    ("deadline zero", _json({"prompt": "x", "deadline_ms": 0}), "at `$.deadline_ms`", KNOWN),
    ("priority out of range", _json({"prompt": "x", "priority": 10**7}), "at `$.priority`",
     KNOWN),
    ("stream not a bool", _json({"prompt": "x", "stream": 1}), "at `$.stream`", KNOWN),
    ("model name empty", _json({"prompt": "x", "model": ""}), "at `$.model`", KNOWN),
    ("deep nesting json", {b"json": b'{"prompt":"x","metadata":{"a":' + b"[" * 100_000
                           + b"]" * 100_000 + b"}}"}, "nests too deeply", None),
    ("deep nesting msgpack",
     {b"msgpack": b"\x82\xa6prompt\xa1x\xa8metadata\x81\xa1a" + b"\x91" * 100_000 + b"\x90"},
     "nests too deeply", None),
    # NOTE: still read for its id (none here: the entry's), so its producer hears of it.
    ("oversized payload", _json({"prompt": "x" * (2 * MAX_PAYLOAD_BYTES)}),
     f"at most {MAX_PAYLOAD_BYTES} allowed", KNOWN),
    ("id with a hash tag", _json({"id": "a{b}", "prompt": "x"}), "at `$.id`", None),
    ("id with a glob", _json({"id": "a*", "prompt": "x"}), "at `$.id`", None),
    ("id with a newline", _json({"id": "abc\n", "prompt": "x"}), "at `$.id`", None),
    ("id of 10k chars", _json({"id": "x" * 10_000, "prompt": "x"}), "at `$.id`", None),
    ("id not a string", _json({"id": 42, "prompt": "x"}), "at `$.id`", None),
]


@pytest.mark.parametrize("fields, fragment, request_id",
                         [case[1:] for case in BAD_ENTRIES], ids=[c[0] for c in BAD_ENTRIES])
def test_bad_entries_are_rejected_naming_the_field(fields: Any, fragment: str,
                                                   request_id: str | None) -> None:
    # Given a malformed or out-of-bounds request entry
    # When a worker decodes it
    outcome = decode_request_entry(ENTRY_ID, fields)
    # Then it is a rejection (never an exception) with a stable code and a message naming the
    # field, which still knows the request id when the payload gave a usable one
    assert isinstance(outcome, RejectedEntry)
    assert outcome.code == "invalid_request"
    assert fragment in outcome.message
    assert outcome.request_id == (ENTRY_ID if request_id == KNOWN else None)
    assert outcome.entry_id == ENTRY_ID


def test_a_rejection_keeps_the_payloads_own_id() -> None:
    outcome = decode_request_entry(ENTRY_ID, _json({"id": "mine", "prompt": "x", "top_p": 0}))
    assert isinstance(outcome, RejectedEntry)
    assert (outcome.request_id, outcome.encoding) == ("mine", "json")


@pytest.mark.parametrize("entry_like", ["1700000000000-0", "0-1"])
def test_an_id_of_the_entry_id_form_is_refused_and_never_names_a_stream(entry_like: str) -> None:
    # An id-less producer follows llmq:r:<its entry id>; no other entry may claim that name.
    outcome = decode_request_entry(ENTRY_ID, _json({"id": entry_like, "prompt": "x"}))
    assert isinstance(outcome, RejectedEntry)
    assert "entry id" in outcome.message and outcome.request_id is None
    with pytest.raises(InvalidRequest, match="entry id"):
        build_submission({"id": entry_like, "prompt": "x"})
    assert isinstance(decode_request_entry(ENTRY_ID, _json({"id": "t:1-0", "prompt": "x"})),
                      DecodedRequest)


def test_a_million_nested_arrays_in_a_full_size_payload_are_rejected_not_crashed() -> None:
    depth = (MAX_PAYLOAD_BYTES - 64) // 2
    fields = {b"json": b'{"prompt":"x","metadata":{"a":' + b"[" * depth + b"]" * depth + b"}}"}
    outcome = decode_request_entry(ENTRY_ID, fields)
    assert isinstance(outcome, RejectedEntry) and "nests too deeply" in outcome.message


@pytest.mark.parametrize("fields", [None, {}])
def test_an_entry_whose_payload_is_gone_is_lost_payload(fields: Any) -> None:
    # Given what XAUTOCLAIM returns for an entry trimmed while pending
    outcome = decode_request_entry(ENTRY_ID, fields)
    assert isinstance(outcome, RejectedEntry)
    assert (outcome.code, outcome.request_id) == ("lost_payload", None)


def test_wire_limits_match_the_engines_sampling_params() -> None:
    from llmq.worker.engine import sampling_params

    assert protocol.MAX_STOP_STRINGS == sampling_params.MAX_STOP_STRINGS
    assert protocol.MAX_STOP_STRING_LEN == sampling_params.MAX_STOP_STRING_LEN
    assert protocol.MAX_LOGPROBS == sampling_params.MAX_LOGPROBS
    assert protocol.MAX_N == sampling_params.MAX_N


_near_bounds = st.one_of(st.integers(-3, 3), st.floats(-3, 3),
                         st.sampled_from([0, 1, 2, 1.0, 2.0, 0.0, -1, 20, 21, 2**63, math.nan,
                                          math.inf, 5e-324]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(
    ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "logprobs",
     "presence_penalty", "frequency_penalty", "repetition_penalty", "n"]), _near_bounds))
def test_every_request_the_wire_accepts_builds_sampling_params(params: dict[str, Any]) -> None:
    # Given any parameters near the bounds, sent as msgpack (which can carry NaN)
    from llmq.worker.engine.sampling_params import SamplingParams

    outcome = decode_request_entry(ENTRY_ID, _msgpack({"prompt": "x", **params}))
    # Then what the wire accepts, the engine accepts too: it never sees a ValueError
    if isinstance(outcome, DecodedRequest):
        SamplingParams(**outcome.request.sampling_kwargs())


# --- the producer validates with the worker's decoder --------------------------------------------


def test_the_producer_refuses_what_a_worker_would_reject_and_sends_nothing() -> None:
    with pytest.raises(InvalidRequest, match=r"at `\$.top_p`"):
        build_submission({"prompt": "x", "top_p": 0})
    with pytest.raises(InvalidRequest, match="unknown field `temprature`"):
        build_submission({"prompt": "x", "temprature": 0})
    with pytest.raises(InvalidRequest, match="cannot be encoded"):
        build_submission({"prompt": "x", "metadata": {"when": object()}})
    with pytest.raises(InvalidRequest, match=f"at most {MAX_PAYLOAD_BYTES}"):
        build_submission({"prompt": "x" * MAX_PAYLOAD_BYTES})


def test_a_submission_is_the_exact_payload_a_worker_decodes() -> None:
    submission = build_submission({"id": "r1", "prompt": "x", "seed": None}, "msgpack")
    assert submission.request_id == "r1"
    decoded = decode_request_entry(ENTRY_ID, {submission.encoding: submission.payload})
    assert isinstance(decoded, DecodedRequest) and decoded.request.seed is None


# --- events --------------------------------------------------------------------------------------

_finite = st.floats(allow_nan=False, allow_infinity=False)
_ids = st.from_regex(r"[A-Za-z0-9_.:-]{1,20}", fullmatch=True)
_attempt = st.integers(1, 10)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _finite | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
_metadata = st.none() | st.dictionaries(st.text(max_size=8), _json_values, max_size=4)
_logprob = st.builds(TokenLogprob, st.integers(0, 2**31), st.none() | _finite,
                     st.lists(st.integers(0, 1000), max_size=3),
                     st.lists(st.none() | _finite, max_size=3))
EVENTS = st.one_of(
    st.builds(Start, _ids, _attempt, st.text(max_size=20), st.integers(0, 10**6),
              st.text(max_size=20)),
    st.builds(Delta, _ids, _attempt, st.integers(0, 10**6), st.text(max_size=30),
              st.lists(st.integers(0, 2**31), max_size=5), st.none() | st.lists(_logprob,
                                                                               max_size=3)),
    st.builds(Done, _ids, _attempt, st.sampled_from(["stop", "length", "cancelled"]),
              st.text(max_size=50), st.builds(Usage, st.integers(0, 10**6), st.integers(0, 10**6),
                                              st.integers(0, 10**6)),
              st.builds(Timings, _finite, st.none() | _finite, _finite, st.none() | _finite),
              st.none() | st.integers(0, 10**6) | st.text(max_size=5), _metadata),
    st.builds(Error, _ids, _attempt, st.sampled_from([c.value for c in protocol.ErrorCode]),
              st.text(max_size=50), st.none() | st.dictionaries(st.text(max_size=5),
                                                                st.integers(-(2**53), 2**53)),
              _metadata),
)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.sampled_from(["json", "msgpack"]))
def test_every_event_round_trips_in_both_encodings(event: Any, encoding: str) -> None:
    # Given any event, When it is written in its request's encoding and read back
    fields = protocol.encode_event(event, encoding)
    # Then the reader gets the same event from one field named after the encoding
    assert list(fields) == [encoding]
    assert protocol.decode_event(fields) == event


def test_events_are_plain_json_objects_tagged_by_type() -> None:
    event = Delta("r1", 2, 0, "Hel", [9906])
    assert json.loads(protocol.encode_event(event)["json"]) == {
        "type": "delta", "request_id": "r1", "attempt": 2, "seq": 0, "text": "Hel",
        "token_ids": [9906], "logprobs": None, "index": 0}


def test_minus_infinity_logprobs_travel_as_null_in_json() -> None:
    event = Delta("r1", 1, 0, "a", [1], [TokenLogprob(1, -0.5, [1, 2], [-0.5, None])])
    assert protocol.decode_event(protocol.encode_event(event, "json")) == event


def test_a_reader_ignores_event_fields_it_does_not_know() -> None:
    raw = {b"json": b'{"type":"start","request_id":"r","attempt":1,"worker":"w",'
                    b'"prompt_tokens":3,"gpu":"none"}'}
    assert protocol.decode_event(raw) == Start("r", 1, "w", 3)


@pytest.mark.parametrize("fields", [
    {b"json": b'{"type":"bogus","request_id":"r","attempt":1}'},
    {b"json": b'{"type":"start"'},
    {b"xml": b"<start/>"},
    {},
])
def test_entries_that_are_not_events_raise_protocol_error(fields: Any) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_event(fields)


# --- cancel notices, dead letters, heartbeats ----------------------------------------------------


def test_cancel_notices_round_trip_and_junk_is_ignored() -> None:
    assert protocol.decode_cancel(protocol.encode_cancel("r-1")) == "r-1"
    assert protocol.decode_cancel({b"json": msgspec.json.encode(CancelNotice("r-2"))}) == "r-2"
    assert protocol.decode_cancel({b"json": b'{"request_id":"a{b}"}'}) is None
    assert protocol.decode_cancel({b"other": b"x"}) is None


def test_a_dead_letter_keeps_the_original_payload_for_a_retry() -> None:
    letter = DeadLetter(queue="default", entry_id=ENTRY_ID, request_id=None,
                        code="invalid_request", message="truncated", deliveries=1)
    original = {b"json": b'{"prompt": "hi"'}
    fields = protocol.encode_dead_letter(letter, original)
    decoded, payload = protocol.decode_dead_letter(fields)
    assert decoded == letter and payload == {"json": b'{"prompt": "hi"'}


def test_a_dead_letter_drops_an_oversized_payload() -> None:
    letter = DeadLetter(queue="q", entry_id=ENTRY_ID, request_id=None, code="invalid_request",
                        message="too big")
    fields = protocol.encode_dead_letter(letter, {b"json": b"x" * (MAX_PAYLOAD_BYTES + 1)})
    assert list(fields) == ["dead_letter"]
    with pytest.raises(ProtocolError):
        protocol.decode_dead_letter({b"json": b"{}"})


def test_heartbeats_are_flat_string_hashes_that_read_back_typed() -> None:
    heartbeat = WorkerHeartbeat(worker_id="w1", queue="default", model="smollm2", pid=42,
                                running=3, waiting=1, kv_usage=0.25, tokens_per_s=51.5)
    fields = protocol.encode_heartbeat(heartbeat)
    assert all(isinstance(v, str) for v in fields.values())
    as_redis_returns_it = {k.encode(): v.encode() for k, v in fields.items()}
    assert protocol.decode_heartbeat(as_redis_returns_it) == heartbeat
    with pytest.raises(ProtocolError):
        protocol.decode_heartbeat({b"worker_id": b"w", b"queue": b"q", b"running": b"many"})


def test_entry_time_is_the_servers_millisecond_clock() -> None:
    assert protocol.entry_time_ms(b"1796013460689-3") == 1796013460689


def test_control_calls_round_trip_and_anything_else_is_not_a_call() -> None:
    # Given a utility call as `llmq admin` writes it
    call = protocol.ControlCall(call_id="call-1", method="sleep", args={"level": 1})
    fields = {k.encode(): v for k, v in protocol.encode_call(call).items()}
    # Then a worker reads it back as it was
    assert protocol.decode_call(fields) == call
    # And entries that are not calls are None: another field, bad JSON, an id that could not
    # name a key, a missing method
    for junk in ({b"msgpack": b"\x80"}, {b"json": b"{"},
                 {b"json": b'{"call_id": "{x}", "method": "stats"}'},
                 {b"json": b'{"call_id": "call-2"}'}):
        assert protocol.decode_call(junk) is None
    reply = protocol.ControlReply(call_id="call-1", worker="w1", ok=True, result={"level": 1})
    assert protocol.decode_reply(protocol.encode_reply(reply)) == reply
