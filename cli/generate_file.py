"""`llmq generate -f FILE`: a JSONL file of wire-format requests through the in-process engine.

Each line is one request exactly as a producer would XADD it (docs/protocol.md); each output
line is the request's terminal event (`done` or `error`) in the same JSON form a result stream
carries, in input order. A bad line gets its `error` line and the others still run.
"""

from __future__ import annotations

from typing import Any, TextIO

import msgspec

from llmq import protocol
from llmq.protocol.errors import ErrorCode, RequestRejected
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.input_processor import InputProcessor

_encoder = msgspec.json.Encoder()


def run_file(engine: EngineCore, lines: TextIO, output: TextIO) -> None:
    """Run every request of `lines`, write one terminal event per line to `output`.

    NOTE: the command's sampling flags do not apply here: a request line carries its own
    parameters, as it would on the wire.
    """
    processor = InputProcessor.for_engine(engine)
    results: list[protocol.Event | None] = []
    # engine id -> (request id, metadata, n, the finished completions by index)
    entries: dict[str, tuple[str, Any, int, dict[int, Any]]] = {}
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
            engine.add_request(str(index), processed.prompt_token_ids,
                               processed.sampling_params, priority=processed.priority)
            entries[str(index)] = (request_id, request.metadata, request.n, {})
        except RequestRejected as e:  # the wire's InvalidRequest included
            results[index] = _error(request_id, e.code, f"line {line_no}: {e.message}")

    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            request_id, metadata, n, finished = entries[out.request_id]
            outputs = protocol.gather_choices(finished, out, n)
            if outputs is not None:
                results[int(out.request_id)] = protocol.terminal_event(request_id, 1, outputs,
                                                                       metadata)
    for event in results:
        output.write(_encoder.encode(event).decode() + "\n")
    output.flush()


def _error(request_id: str, code: ErrorCode, message: str) -> protocol.Error:
    return protocol.Error(request_id=request_id, attempt=1, code=code, message=message)
