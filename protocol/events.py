"""Events on llmq:r:{<request_id>}: start, delta, then one terminal done or error per attempt.

A reader follows the highest attempt (`llmq.broker.transcript`): a `start` with a higher attempt
supersedes the text of earlier ones. `terminal_event` builds the done/error closing an attempt
from the engine's finished output, for the worker's result writer and `llmq generate -f` alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec
from msgspec import Meta, Struct

from llmq.protocol.encoding import ENCODINGS, Encoding, encoders, field_items
from llmq.protocol.errors import ErrorCode, ProtocolError

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
    # the tokens' text (protocol/token_text.py), when the worker has a tokenizer
    token: str | None = None
    top_tokens: list[str] = []
    rank: int | None = None  # prompt logprobs: the token's rank among all (1 = most likely)


class Tokens(Struct):
    """A tokenize request's answer (`task: tokenize`), in vLLM's /tokenize terms."""

    token_ids: list[int]
    token_strs: list[str]  # each id's vocabulary string (`Ġsea`), as `convert_ids_to_tokens`
    max_model_len: int  # the worker's context: prompt and output tokens together


FinishReason = Literal["stop", "length", "cancelled"]  # how a completion of `done` ended
_FINISH_REASONS: dict[str | None, FinishReason] = {
    "stop": "stop", "length": "length", "cancelled": "cancelled"}


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
    finish_reason: FinishReason
    completion_tokens: int
    stop_reason: int | str | None = None


class Done(_EventBase, tag="done"):
    """The attempt finished; `text` is the whole output (the deltas concatenated)."""

    finish_reason: FinishReason
    text: str
    usage: Usage
    timings: Timings
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    metadata: dict[str, Any] | None = None
    # n > 1: every completion, by index; `text`, `finish_reason`, `stop_reason` are choice 0's
    # and `usage` counts the prompt once and the completions' tokens together.
    choices: list[Choice] | None = None
    # `prompt_logprobs`: one per prompt token, None for the first (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # answers of a request with a `task` other than generate (`text` is detokenize's)
    embedding: list[float] | None = None  # task embed: the prompt's vector, unit length
    tokens: Tokens | None = None  # task tokenize


class Error(_EventBase, tag="error"):
    """The attempt failed; `code` is an `ErrorCode` value, `message` names the field at fault."""

    code: str
    message: str
    details: dict[str, Any] | None = None  # machine-readable specifics, e.g. {"limit": 2048}
    metadata: dict[str, Any] | None = None


Event = Start | Delta | Done | Error


def is_terminal(event: Event) -> bool:
    return isinstance(event, Done | Error)


class FinishedOutput(Protocol):
    """What `terminal_event` reads of a finished request (the engine's `EngineCoreOutput`)."""

    index: int  # which of the request's n completions
    finish_reason: str | None  # stop | length | cancelled | error
    text: str | None
    usage: Usage | None
    timings: Timings | None
    stop_reason: int | str | None
    error_code: str | None
    error_message: str | None
    prompt_logprobs: list[TokenLogprob | None] | None
    embedding: list[float] | None
    tokens: Tokens | None


Output = TypeVar("Output", bound=FinishedOutput)


def gather_choices(finished: dict[int, Output], output: Output, n: int) -> list[Output] | None:
    """Keep one finished completion of a request asking for `n`; all of them in index order
    once the last one finished (one terminal event per attempt), else None."""
    finished[output.index] = output
    if len(finished) < n:
        return None
    return [finished[i] for i in range(n)]


def terminal_event(request_id: str, attempt: int,
                   output: FinishedOutput | Sequence[FinishedOutput],
                   metadata: dict[str, Any] | None = None) -> Done | Error:
    """The `done` or `error` event closing an attempt, from the engine's finished output (with
    n > 1: its n finished completions in index order, see `gather_choices`).

    The one builder: the worker writes it to the result stream, `llmq generate -f` prints it.
    With several completions the event is choice 0's, or the first failure if any failed;
    `usage` counts the prompt once and every completion's tokens, `timings` span them all.
    """
    outputs = list(output) if isinstance(output, Sequence) else [output]
    first = next((o for o in outputs if o.finish_reason == "error"), outputs[0])
    if first.finish_reason == "error":
        return Error(request_id=request_id, attempt=attempt,
                     code=first.error_code or ErrorCode.ENGINE_ERROR,
                     message=first.error_message or "the engine failed this request",
                     metadata=metadata)
    choices = None
    if len(outputs) > 1:
        choices = [Choice(index=o.index, text=o.text or "",
                          finish_reason=_finish_reason(o),
                          completion_tokens=o.usage.completion_tokens if o.usage else 0,
                          stop_reason=o.stop_reason) for o in outputs]
    return Done(request_id=request_id, attempt=attempt,
                finish_reason=_finish_reason(first),
                text=first.text or "", usage=_usage(outputs), timings=_timings(outputs),
                stop_reason=first.stop_reason, metadata=metadata, choices=choices,
                prompt_logprobs=first.prompt_logprobs, embedding=first.embedding,
                tokens=first.tokens)


def _finish_reason(output: FinishedOutput) -> FinishReason:
    """A completion's reason as `done` carries it; ValueError for a reason `done` cannot carry
    (readers would refuse the event)."""
    try:
        return _FINISH_REASONS[output.finish_reason]
    except KeyError:
        raise ValueError(f"completion {output.index} cannot end a `done` event: its "
                         f"finish_reason is {output.finish_reason!r}") from None


def _usage(outputs: list[FinishedOutput]) -> Usage:
    usages = [o.usage for o in outputs if o.usage is not None]
    if not usages:
        return Usage(0, 0, 0)
    # NOTE: the completions share one prefill: the prompt counts once.
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                 usages[0].cached_prompt_tokens)


def _timings(outputs: list[FinishedOutput]) -> Timings:
    spans = [o.timings for o in outputs if o.timings is not None]
    if len(spans) <= 1:
        return spans[0] if spans else Timings(0.0, None, 0.0, None)
    ttfts = [t.ttft for t in spans if t.ttft is not None]
    gaps = [t.per_token for t in spans if t.per_token is not None]
    return Timings(queue=min(t.queue for t in spans), ttft=min(ttfts) if ttfts else None,
                   e2e=max(t.e2e for t in spans), per_token=sum(gaps) / len(gaps) if gaps else None)


_event_decoders: dict[str, msgspec.json.Decoder[Event] | msgspec.msgpack.Decoder[Event]] = {
    "json": msgspec.json.Decoder(Event), "msgpack": msgspec.msgpack.Decoder(Event)}


def encode_event(event: Event, encoding: Encoding = "json") -> dict[str, bytes]:
    """The fields of a result stream entry, in the encoding of the event's request."""
    return {encoding: encoders[encoding].encode(event)}


def decode_event(fields: Mapping[Any, Any]) -> Event:
    """One result stream entry as an event; ProtocolError when it is not one."""
    items = field_items(fields) if fields else []
    if len(items) != 1 or items[0][0] not in ENCODINGS:
        raise ProtocolError(f"an event entry has one field, `json` or `msgpack`; got "
                            f"{[name[:40] for name, _ in items[:8]]}")
    encoding, payload = items[0]
    try:
        return _event_decoders[encoding].decode(payload)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise ProtocolError(f"undecodable {encoding} event: {exc}") from None

