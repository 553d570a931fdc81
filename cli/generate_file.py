"""`llmq generate -f FILE`: a JSONL file of wire-format requests through the in-process engine.

Each line is one request exactly as a producer would XADD it (docs/protocol.md); each output
line is the request's terminal event (`done` or `error`) in the same JSON form a result stream
carries, in input order. A bad line gets its `error` line and the others still run.
"""

from __future__ import annotations

from typing import TextIO

import msgspec

from llmq.broker import protocol
from llmq.broker.errors import InvalidRequest
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.input_processor import InputProcessor
from llmq.worker.engine.scheduler import RequestRejected
from llmq.worker.inflight_table import InFlight
from llmq.worker.result_writer import combine_choices, terminal_event

_encoder = msgspec.json.Encoder()


def run_file(engine: EngineCore, lines: TextIO, output: TextIO) -> None:
    """Run every request of `lines`, write one terminal event per line to `output`.

    NOTE: the command's sampling flags do not apply here: a request line carries its own
    parameters, as it would on the wire.
    """
    processor = InputProcessor(engine.tokenizer, engine.config.max_model_len,
                               engine.arch.vocab_size, engine.structured_output)
    results: list[protocol.Event | None] = []
    entries: dict[str, InFlight] = {}
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        index = len(results)
        results.append(None)
        request_id = f"line-{line_no}"
        try:
            request = protocol.parse_request(line.encode(), "json")
            request_id = request.id or request_id
            processed = processor.process(request)
            entry = InFlight(str(index), request_id, attempt=1, encoding="json",
                             metadata=request.metadata, n=request.n)
            engine.add_request(str(index), processed.prompt_token_ids,
                               processed.sampling_params, priority=processed.priority)
            entries[str(index)] = entry
        except InvalidRequest as e:
            results[index] = _error(request_id, "invalid_request", f"line {line_no}: {e}")
        except RequestRejected as e:
            results[index] = _error(request_id, e.code, f"line {line_no}: {e.message}")

    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            entry = entries[out.request_id]
            if entry.n == 1:
                results[int(out.request_id)] = terminal_event(entry, out)
                continue
            entry.finished_choices[out.index] = out
            if len(entry.finished_choices) == entry.n:
                choices = [entry.finished_choices[i] for i in range(entry.n)]
                results[int(out.request_id)] = terminal_event(entry, combine_choices(choices),
                                                              choices)
    for event in results:
        output.write(_encoder.encode(event).decode() + "\n")
    output.flush()


def _error(request_id: str, code: str, message: str) -> protocol.Error:
    return protocol.Error(request_id=request_id, attempt=1, code=str(code), message=message)
