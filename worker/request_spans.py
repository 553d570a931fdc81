"""RequestSpans: the worker's OpenTelemetry spans of one request, per phase, never per token.

A request's spans are built once it is over, on the result writer's thread, from times the
worker already keeps (as vLLM's output processor does for its `llm_request` span): nothing runs
on the busy loop, and a worker that does not trace (`ctx.spans is None`) pays one `is None` test
per read and per write. The spans, children of the producer's `traceparent` (protocol/requests.py)
when the request carries one:

    llm_request      CONSUMER, XADD -> terminal event written; vLLM's `gen_ai.*` attributes;
                     status ERROR with the code for an `error`
      queue_wait     XADD -> this worker read the entry (Redis's clock: both are its TIME)
      admission      read -> handed to the busy loop (decode, checks, tokenizing), or to the
                     write of its answer when admission answered it (refused, past its
                     deadline, cancelled before it started: no engine phase then)
      prefill        first scheduled -> first token (the engine's timings)
      decode         first token -> last token
      result_write   the write (MULTI/EXEC) that carried the terminal event and the ack

The engine measures its timings from the entry's time as admission computes it (Redis `TIME`
minus the entry id's milliseconds, counted back from when the request was handed over), so
prefill and decode are placed on the same origin here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmq import protocol
from llmq.broker import tracing
from llmq.worker.engine.outputs import EngineCoreOutput

if TYPE_CHECKING:
    from llmq.broker.tracing import Tracing
    from llmq.worker.inflight_table import InFlightTable

__all__ = ["RequestSpans", "RequestTrace"]

NS = 1_000_000_000


@dataclass
class RequestTrace:
    """What a request's spans need, kept on its in-flight entry from the read on."""

    traceparent: str | None
    read_ns: int  # this worker's clock when Redis answered TIME after the read
    waited_ns: int  # XADD -> that TIME, on Redis's clock
    admitted_ns: int = 0  # handed to the busy loop; 0: never (answered at admission)
    attributes: dict[str, Any] = field(default_factory=dict)  # the request's own

    @property
    def entry_ns(self) -> int:
        return self.read_ns - self.waited_ns


class RequestSpans:
    """Builds the spans of finished requests for one worker."""

    def __init__(self, tracing_: Tracing, queue: str, worker_id: str, model_name: str) -> None:
        self.tracing = tracing_
        self.common = {"llmq.queue": queue, "llmq.worker": worker_id,
                       tracing.MESSAGING_SYSTEM: "llmq", tracing.RESPONSE_MODEL: model_name}

    @classmethod
    def for_process(cls, queue: str, worker_id: str, model_name: str) -> RequestSpans | None:
        """The process's spans (broker/tracing.py decides), or None when it does not trace."""
        current = tracing.current()
        return None if current is None else cls(current, queue, worker_id, model_name)

    def read(self, decoded: protocol.DecodedRequest | protocol.RejectedEntry,
             now_ms: int) -> RequestTrace:
        """At admission, once Redis's TIME is known: the entry's times and request fields."""
        waited_ms = max(0, now_ms - protocol.entry_time_ms(decoded.entry_id))
        trace = RequestTrace(None, time.time_ns(), waited_ms * 1_000_000)
        if isinstance(decoded, protocol.DecodedRequest):
            request = decoded.request
            trace.traceparent = request.traceparent
            trace.attributes = {tracing.REQUEST_MAX_TOKENS: request.max_tokens or 0,
                                tracing.REQUEST_TEMPERATURE: request.temperature,
                                tracing.REQUEST_TOP_P: request.top_p,
                                tracing.REQUEST_N: request.n}
            if request.model is not None:
                trace.attributes[tracing.REQUEST_MODEL] = request.model
        return trace

    def finished(self, finished: list[tuple[protocol.Done | protocol.Error, EngineCoreOutput]],
                 table: InFlightTable, write_started_ns: int) -> None:
        """After the write that carried these terminal events: every request's spans."""
        written_ns = time.time_ns()
        for terminal, output in finished:
            entry = table.get(output.request_id)
            if entry is None or entry.trace is None or not entry.trace.admitted_ns:
                continue
            timings = (terminal.timings if isinstance(terminal, protocol.Done)
                       else output.timings)
            self._emit(entry.trace, terminal, timings, {
                tracing.REQUEST_ID: entry.request_id, "llmq.entry_id": entry.entry_id,
                "llmq.attempt": entry.attempt}, write_started_ns, written_ns)

    def answered(self, answered: list[tuple[str, protocol.Done | protocol.Error]],
                 table: InFlightTable, write_started_ns: int) -> None:
        """Requests answered at admission (refused, past their deadline, cancelled before they
        started): llm_request with queue_wait, admission and the answer's result_write."""
        written_ns = time.time_ns()
        for entry_id, terminal in answered:
            entry = table.get(entry_id)
            if entry is None or entry.trace is None:
                continue
            # NOTE: never handed over: admission ends with the write of its answer.
            entry.trace.admitted_ns = entry.trace.admitted_ns or write_started_ns
            self._emit(entry.trace, terminal, None, {
                tracing.REQUEST_ID: entry.request_id, "llmq.entry_id": entry.entry_id,
                "llmq.attempt": entry.attempt}, write_started_ns, written_ns)

    def _emit(self, trace: RequestTrace, terminal: protocol.Done | protocol.Error,
              timings: protocol.Timings | None, ids: dict[str, Any], write_started_ns: int,
              written_ns: int) -> None:
        from opentelemetry import trace as otel
        from opentelemetry.trace import SpanKind, Status, StatusCode

        tracer = self.tracing.tracer
        attributes = {**self.common, **trace.attributes, **ids}
        if isinstance(terminal, protocol.Done):
            attributes["gen_ai.response.finish_reasons"] = [terminal.finish_reason]
            attributes[tracing.USAGE_PROMPT_TOKENS] = terminal.usage.prompt_tokens
            attributes[tracing.USAGE_COMPLETION_TOKENS] = terminal.usage.completion_tokens
        else:
            attributes["error.type"] = terminal.code
        # NOTE: the engine's origin: admission handed the request over `waited` after the XADD
        # as Redis counts it, so the engine's zero is that far before the hand-over.
        origin_ns = trace.admitted_ns - trace.waited_ns
        phases: list[tuple[str, int, int]] = [
            ("queue_wait", trace.entry_ns, trace.read_ns),
            ("admission", trace.read_ns, trace.admitted_ns)]
        if timings is not None:
            attributes[tracing.LATENCY_TIME_IN_QUEUE] = timings.queue
            attributes[tracing.LATENCY_E2E] = timings.e2e
            if timings.ttft is not None:
                attributes[tracing.LATENCY_TTFT] = timings.ttft
                attributes[tracing.LATENCY_PREFILL] = timings.ttft - timings.queue
                attributes[tracing.LATENCY_DECODE] = timings.e2e - timings.ttft
                first_ns = origin_ns + int(timings.ttft * NS)
                phases += [("prefill", origin_ns + int(timings.queue * NS), first_ns),
                           ("decode", first_ns, origin_ns + int(timings.e2e * NS))]
        phases.append(("result_write", write_started_ns, written_ns))
        root = tracer.start_span("llm_request", context=self.tracing.context_of(
            trace.traceparent), kind=SpanKind.CONSUMER, attributes=attributes,
            start_time=trace.entry_ns)
        if isinstance(terminal, protocol.Error):
            root.set_status(Status(StatusCode.ERROR, f"{terminal.code}: {terminal.message}"))
        parent = otel.set_span_in_context(root)
        for name, start_ns, end_ns in phases:
            span = tracer.start_span(name, context=parent, start_time=start_ns)
            span.end(end_time=max(start_ns, end_ns))
        root.end(end_time=written_ns)
