"""FileJob: `llmq submit -f requests.jsonl -o results.jsonl`, pipelined and resumable.

Each input line is a request object in the wire format (docs/protocol.md); the sampling flags of
the command fill the fields a line leaves out. Every line gets a request id: its `id` field, else
a stable hash of the file's path, the line number and the line's text, so a rerun maps each line
to the same id. All lines are validated, then run by the `OrderedRun` (broker/ordered_run.py):
submitted at once (one pipelined round trip per thousand), followed together, and their results
written as JSONL in input order, one flushed line at a time, so a killed run leaves a valid
prefix behind.

Rerunning the same command resumes: results already in the output file are kept and their
requests are not submitted again; the others are submitted with the same ids, which the broker's
idempotent submit turns into "follow the request already queued" for any that an earlier run sent.
A line that cannot be parsed or validated gets an error result (with its line number) and the
rest go on.

The job prints nothing itself: it tells a `FileJobListener` how it goes (the CLI's draws a
progress bar on stderr; the default one logs).

Result lines:

    {"id": "...", "line": 3, "finish_reason": "stop", "text": "...", "usage": {...},
     "timings": {...}, "metadata": {...}}      (with n > 1, also "choices": [{"index", "text",
                                                 "finish_reason"}, ...], every completion)
    {"id": "...", "line": 4, "error": {"code": "invalid_request", "message": "..."}}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import msgspec

from llmq.broker.client import Client
from llmq.broker.commands import build_submission
from llmq.broker.ordered_run import OrderedRun, RunEnd, Settled, Submit
from llmq.broker.transcript import Transcript
from llmq.protocol import Done, Error
from llmq.protocol.errors import ErrorCode, InvalidRequest
from llmq.protocol.names import is_valid_name

__all__ = ["FileJob", "FileJobListener", "FileLine", "OutputFile", "derive_request_id",
           "read_lines", "write_record"]

logger = logging.getLogger(__name__)

# NOTE: JSON allows U+0085, U+2028 and U+2029 raw inside strings, but Python's str.splitlines()
# and JavaScript end a line there: escaped, every result stays one line for any JSONL reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class FileJobListener(Protocol):
    """What a file job tells whoever watches it, in this order: started, then submitting (when
    anything is left to submit) and advanced as lines get their results, stopped, and notes."""

    def started(self, total: int, already_done: int) -> None:
        """`total` lines, of which an earlier run already wrote `already_done`."""

    def submitting(self, num_requests: int) -> None:
        """About to queue `num_requests` requests."""

    def advanced(self, *, done: int, failed: int = 0, tokens: int = 0) -> None:
        """`done` more lines have their result, `failed` of them errors; `tokens` generated."""

    def tick(self) -> None:
        """Called between rounds (about every 250 ms), results or not: time to redraw."""

    def stopped(self) -> None:
        """No more progress: finished, timed out or interrupted."""

    def note(self, message: str) -> None:
        """A message for the person running the job (the summary, how to resume)."""


class LoggingListener:
    """The default `FileJobListener`: notes and the start go to this module's logger."""

    def started(self, total: int, already_done: int) -> None:
        logger.info("file job: %d lines, %d already done", total, already_done)

    def submitting(self, num_requests: int) -> None:
        logger.info("file job: submitting %d requests", num_requests)

    def advanced(self, *, done: int, failed: int = 0, tokens: int = 0) -> None:
        pass

    def tick(self) -> None:
        pass

    def stopped(self) -> None:
        pass

    def note(self, message: str) -> None:
        logger.info("%s", message)


@dataclass
class FileLine:
    number: int  # 1-based line number in the input
    request_id: str
    body: dict[str, Any] | None  # the request to submit, None when the line failed
    error: str | None = None  # why the line cannot be submitted


def derive_request_id(path_key: str, number: int, text: str) -> str:
    """A request id stable across reruns of the same file: line number + content hash."""
    digest = hashlib.sha256(f"{path_key}\n{number}\n{text}".encode()).hexdigest()[:20]
    return f"L{number}-{digest}"


def read_lines(lines: list[str], path_key: str, defaults: dict[str, Any]) -> list[FileLine]:
    """Parse and validate every non-blank line; failures become FileLines with an error."""
    parsed: list[FileLine] = []
    first_seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.rstrip("\r\n")
        if not text.strip():
            continue
        derived = derive_request_id(path_key, number, text)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            parsed.append(FileLine(number, derived, None, f"line {number}: not JSON: {exc}"))
            continue
        if not isinstance(obj, dict):
            parsed.append(FileLine(number, derived, None,
                                   f"line {number}: not a JSON object (a request is {{...}})"))
            continue
        given = obj.get("id")
        request_id = given if isinstance(given, str) and is_valid_name(given) else derived
        if request_id in first_seen:
            parsed.append(FileLine(number, derived, None,
                                   f"line {number}: duplicate id {request_id!r} (first on line "
                                   f"{first_seen[request_id]})"))
            continue
        first_seen[request_id] = number
        body = {"stream": False, **defaults, **obj, "id": given if given is not None
                else request_id}
        try:
            build_submission(body)  # the worker's own decoder: what passes here runs there
        except InvalidRequest as exc:
            parsed.append(FileLine(number, request_id, None, f"line {number}: {exc}"))
            continue
        parsed.append(FileLine(number, request_id, body))
    return parsed


def result_record(line: FileLine, final: Done | Error) -> dict[str, Any]:
    if isinstance(final, Error):
        return error_record(line, final.code, final.message)
    record: dict[str, Any] = {
        "id": line.request_id, "line": line.number, "finish_reason": final.finish_reason,
        "text": final.text, "usage": msgspec.to_builtins(final.usage),
        "timings": msgspec.to_builtins(final.timings)}
    if final.choices and len(final.choices) > 1:  # n > 1: every completion, by index
        record["choices"] = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
                             for c in final.choices]
    if final.metadata is not None:
        record["metadata"] = final.metadata
    return record


def error_record(line: FileLine, code: str, message: str) -> dict[str, Any]:
    return {"id": line.request_id, "line": line.number,
            "error": {"code": code, "message": message}}


class OutputFile:
    """The results file: what an earlier run wrote, and appending in input order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.existing: dict[str, dict[str, Any]] = {}  # request id -> result record
        self._ids: list[str] = []  # ids of the complete lines, in file order
        self._ends: list[int] = []  # byte offset after each complete line
        if path != "-" and os.path.exists(path):
            self._load()

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        offset = 0
        for raw in data.splitlines(keepends=True):
            offset += len(raw)
            if not raw.endswith(b"\n"):
                break  # a line cut short by a kill: rewritten below
            try:
                record = json.loads(raw)
            except ValueError:
                break
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                break
            self.existing[record["id"]] = record
            self._ids.append(record["id"])
            self._ends.append(offset)

    def open_after_prefix(self, input_ids: list[str]) -> tuple[TextIO, int]:
        """Keep the longest prefix of the file that matches the input order; open for append.

        Returns (stream, number of input lines already written in place).
        """
        if self.path == "-":
            return sys.stdout, 0
        kept = 0
        while (kept < len(self._ids) and kept < len(input_ids)
               and self._ids[kept] == input_ids[kept]):
            kept += 1
        # NOTE: results after the kept prefix are remembered in `existing` and rewritten in input
        # order, so the file always ends up in input order, whatever an earlier run left.
        stream = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - closed by FileJob
        stream.truncate(self._ends[kept - 1] if kept else 0)
        stream.seek(0, os.SEEK_END)
        return stream, kept


class FileJob:
    """`path` ("-": stdin) in, `output` ("-": stdout) out; `defaults` fill the request fields a
    line leaves out; `timeout` s bounds the wait for results (None: wait for all)."""

    def __init__(self, client: Client, path: str, output: str, defaults: dict[str, Any], *,
                 timeout: float | None = None, listener: FileJobListener | None = None) -> None:
        self.client = client
        self.path = path
        self.output = output
        self.defaults = defaults
        self.timeout = timeout
        self.listener: FileJobListener = listener if listener is not None else LoggingListener()
        self.num_skipped = 0  # lines whose results an earlier run wrote
        self.num_failed = 0  # lines whose result is an error, this run's and earlier ones
        self.num_tokens = 0  # tokens generated for this run's lines
        self._file_lines: list[FileLine] = []  # the lines this run handles (after the kept ones)
        self._stream: TextIO = sys.stdout

    def run(self) -> int:
        """Submit, follow and write everything; the exit code (0: every line has its result)."""
        if self.path == "-":
            lines, path_key = sys.stdin.readlines(), "<stdin>"
        else:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
            path_key = os.path.abspath(self.path)
        file_lines = read_lines(lines, path_key, self.defaults)
        out = OutputFile(self.output)
        stream, kept = out.open_after_prefix([line.request_id for line in file_lines])
        try:
            return self._run(file_lines, out, stream, kept)
        finally:
            if stream is not sys.stdout:
                stream.close()

    def _run(self, file_lines: list[FileLine], out: OutputFile, stream: TextIO, kept: int) -> int:
        self._file_lines = file_lines[kept:]
        self._stream = stream
        lines: list[Submit | Settled[dict[str, Any]]] = []
        reused: list[FileLine] = []  # after the kept prefix, with a result from earlier
        new_errors = 0
        for line in self._file_lines:
            if line.request_id in out.existing:
                lines.append(Settled({**out.existing[line.request_id], "line": line.number}))
                reused.append(line)
            elif line.error is not None or line.body is None:
                lines.append(Settled(error_record(line, ErrorCode.INVALID_REQUEST,
                                                  line.error or "")))
                new_errors += 1
            else:
                lines.append(Submit(line.request_id, line.body))
        self.num_skipped = kept + len(reused)
        self.num_failed = sum("error" in out.existing[line.request_id]
                              for line in [*file_lines[:kept], *reused])
        listener = self.listener
        listener.started(len(file_lines), self.num_skipped)
        self.num_failed += new_errors
        if new_errors:
            listener.advanced(done=new_errors, failed=new_errors)
        to_submit = len(lines) - len(reused) - new_errors
        if to_submit:
            listener.submitting(to_submit)
        run = OrderedRun(self.client, lines, self, timeout=self.timeout)
        try:
            end = run.run()
        except KeyboardInterrupt:
            listener.stopped()
            listener.note(f"interrupted: {kept + run.written} of {len(file_lines)} results "
                          "written; rerun the same command to resume (queued requests are not "
                          "queued again)")
            return 130
        listener.stopped()
        if end is RunEnd.TIMED_OUT:
            listener.note(f"timed out: {run.unfinished} request(s) still queued or running; "
                          "rerun the same command to collect them")
            return 1
        self._summary(len(file_lines))
        return 0

    # -- the RunSink of the OrderedRun --------------------------------------------------------

    def finished(self, index: int, transcript: Transcript) -> dict[str, Any]:
        final = transcript.final
        assert final is not None
        if isinstance(final, Done):
            self.num_tokens += final.usage.completion_tokens
            self.listener.advanced(done=1, tokens=final.usage.completion_tokens)
        else:
            self.num_failed += 1
            self.listener.advanced(done=1, failed=1)
        return result_record(self._file_lines[index], final)

    def not_run(self, index: int, *, submitted: bool) -> dict[str, Any]:
        raise AssertionError("a file job is never stopped (stop_requested is False)")

    def write(self, record: dict[str, Any]) -> None:
        write_record(self._stream, record)

    def tick(self, submitted: int) -> None:
        self.listener.tick()

    def stop_requested(self) -> bool:
        return False

    def _summary(self, total: int) -> None:
        failed = self.num_failed
        where = "" if self.output == "-" else f" -> {self.output}"
        skipped = f" ({self.num_skipped} already done)" if self.num_skipped else ""
        self.listener.note(f"{total} requests: {total - failed} ok, {failed} failed{skipped}; "
                           f"{self.num_tokens} tokens generated{where}")


def write_record(stream: TextIO, record: dict[str, Any]) -> None:
    """One result line, flushed (a killed run leaves whole lines)."""
    stream.write(json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS) + "\n")
    stream.flush()
